"""GRPO with the expert-parallel rollout copy (`rl.rollout.weights = "expert_parallel"`) through the trainer.

Two gloo processes, parallel.ep = 2, the tiny Qwen3-VL-MoE, native layers, two GRPO steps: the copy is built by
`build_rollout_engine` from the trainer's FSDP + ep shards, decodes in lock-step through its own experts and is
refreshed after the first update. The loss, grad norm and reward of both steps must equal the run whose rollout
goes through the trainer's own parameters ("shared"), which gathers every block per decode step (same
sampling: the same random draws per slot and step, the same weights at every step). A stale copy (no refresh)
would decode step 2 with the step-0 weights and change its samples.
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
    for weights in ("shared", "expert_parallel"):
        runs[weights] = tmp / "grpo" / weights
        _grpo(model, runs[weights], init_distributed(), **{"parallel.ep": 2, "rl.rollout.weights": f'"{weights}"'})
    if rank == 0:
        assert _column(runs["shared"], "grad_norm")[0] > 0
        for key in ("loss", "grad_norm", "reward/mean"):
            ref, got = _column(runs["shared"], key), _column(runs["expert_parallel"], key)
            scale = max(1.0, max(abs(v) for v in ref))
            assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, (key, ref, got)
    dist.barrier()


def test_grpo_with_the_expert_parallel_rollout_copy_matches_shared(tmp_path):
    spawn(tmp_path, _parts)
