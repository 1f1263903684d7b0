"""GRPO with the expert-parallel rollout copy (`rl.rollout.weights = "expert_parallel"`) through the trainer.

Two gloo processes, parallel.ep = 2, the tiny Qwen3-VL-MoE, native layers, two GRPO steps: the copy is built by
`build_rollout_engine` from the trainer's FSDP + ep shards, decodes in lock-step through its own experts and is
refreshed after the first update. The loss, grad norm and reward of both steps must equal the run whose rollout
goes through the trainer's own parameters ("shared"), which gathers every block per decode step (same
sampling: the same random draws per slot and step, the same weights at every step). A stale copy (no refresh)
would decode step 2 with the step-0 weights and change its samples. With rl.routing_replay = "rollout" the
copy records the routes (its experts are this rank's, the router ids global) and the training forwards replay
them: the runs again equal the "shared" ones, routing mismatch included.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_vlm.parallel import init_distributed
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_tp_cp_families import _column, _grpo

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two processes, two GRPO runs


def _parts(tmp: Path, rank: int) -> None:
    model = tmp / "grpo" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen3_vl_moe", model, seed=0)
    dist.barrier()
    runs = {}
    for replay in ("off", "rollout"):
        for weights in ("shared", "expert_parallel"):
            runs[weights, replay] = tmp / "grpo" / f"{weights}_{replay}"
            _grpo(model, runs[weights, replay], init_distributed(), **{
                "parallel.ep": 2, "rl.rollout.weights": f'"{weights}"', "rl.routing_replay": f'"{replay}"'})
    if rank == 0:
        for replay in ("off", "rollout"):
            shared, ep = runs["shared", replay], runs["expert_parallel", replay]
            assert _column(shared, "grad_norm")[0] > 0
            for key in ("loss", "grad_norm", "reward/mean"):
                ref, got = _column(shared, key), _column(ep, key)
                scale = max(1.0, max(abs(v) for v in ref))
                assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                    (replay, key, ref, got)
        # routing replay: the copy's recorded routes reach the training forwards, which then route as the rollout did
        assert _column(runs["expert_parallel", "rollout"], "rollout/routing_mismatch_frac") == \
            _column(runs["shared", "rollout"], "rollout/routing_mismatch_frac")
    dist.barrier()


def test_grpo_with_the_expert_parallel_rollout_copy_matches_shared(tmp_path):
    spawn(tmp_path, _parts)
