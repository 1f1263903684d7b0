"""The graph-safe form of the expert-parallel MoE block (`ExpertParallelExperts.static_forward`, decode steps).

2 gloo processes, ep = 2, every rank stepping the same number of rows with different tokens: inside
`static_routing()` (the rollout engine's static decode step) the EP block's output equals the unsharded block's
on the same rank's input in one process (fp32, within 1e-5), in both static forms (grouped GEMMs, where torch
takes them, and dense), for the NemotronH-style block (sigmoid router, latent space, relu2 experts) and the
Qwen3-MoE-style block (softmax, SwiGLU experts), including a routing bias that sends every token to rank 0's
experts (rank 1 computes nothing of its own); and the whole forward reads no tensor value on the host
(`GraphSafetyProbe`, the check a CUDA-graph capture needs). The lock-stepped rollout engine on the EP copy in
static steps equals the one-process engine, and its ranks start new decode runners (CUDA-graph captures, whose
warm-up runs the collectives twice more) at the same step even when only one rank's slot length changed.
"""
from __future__ import annotations

import copy
import datetime
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.inference.decode_graphs import GraphSafetyProbe, GraphUnsafeError
from megatron_vlm.kernels import static_experts as moe_static
from megatron_vlm.models.common.moe_static import static_routing
from tests.unit.parallel.test_expert_parallel import HIDDEN, _sigmoid_block, _sigmoid_block_all_to_rank0, _softmax_block

pytestmark = pytest.mark.distributed

WORLD = 2
ROWS = 5


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from megatron_vlm.parallel.expert_parallel import apply_ep

        group = dist.new_group(list(range(WORLD)))
        for make in (_sigmoid_block, _softmax_block, _sigmoid_block_all_to_rank0):
            full = make().eval()
            x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
            with torch.no_grad():
                want = full(x[None])[0]
                ep = copy.deepcopy(full)
                apply_ep([ep], group)
                takes = moe_static._grouped_mm_takes
                forms = {"dense": lambda *a: False, "auto": takes}  # "auto": grouped where torch takes the operands
                for form, rule in forms.items():
                    moe_static._grouped_mm_takes = rule
                    try:
                        with static_routing(), GraphSafetyProbe() as probe:
                            got = ep(x[None])[0]
                    finally:
                        moe_static._grouped_mm_takes = takes
                    assert not probe.host_reads, (make.__name__, form, probe.host_reads)
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{make.__name__} {form} rank {rank}")
                eager = ep(x[None])[0]  # the all-to-all form (prefill), for comparison
                torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


def test_static_expert_parallel_block_equals_the_unsharded_block(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def _rollout_worker(rank: int, init_file: str, folder, root) -> None:
    """The expert-parallel rollout copy decoding in static steps ("on": the CUDA-graph form, eager here) against
    the one-process engine on the full model: same greedy tokens, log-probs, routes; rank 1 finishes first and
    steps dummy rows (the scratch slot in the one bucket). A later call whose slot length changes on one rank
    only starts new runners (graph captures on CUDA) on every rank at the same step; a capture that fails on
    one rank makes every rank fall back to eager steps ("auto") at the same step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # mismatched collectives: an error, not a hang
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from megatron_vlm.checkpoint.hf import load_hf_model
        from megatron_vlm.data.processor import load_processor
        from megatron_vlm.inference.decode_graphs import DecodeStepRunner
        from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
        from megatron_vlm.inference.ep_rollout import ExpertParallelRolloutEngine, build_ep_rollout_copy
        from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
        from megatron_vlm.models.common.moe import moe_layers
        from megatron_vlm.parallel.collectives import any_rank
        from megatron_vlm.parallel.expert_parallel import apply_ep, expert_parameters
        from tests.unit.parallel.test_ep_rollout import BUDGETS, PER_RANK, _generate, _prompts, _same

        mesh = init_device_mesh("cpu", (WORLD,))
        tok = load_processor(str(folder)).tokenizer
        full = load_hf_model(str(folder), dtype=torch.float32).eval()
        prompts = _prompts("tiny_qwen3_moe", folder, root, full.lm_head.weight.shape[0])
        mine, budget = prompts[rank * PER_RANK:(rank + 1) * PER_RANK], BUDGETS[rank]
        want = _generate(PolicyRolloutEngine(full, tok, EngineOptions(eos_token_ids=[-1], record_routes=True)), mine, budget)
        trainer = load_hf_model(str(folder), dtype=torch.float32)
        apply_ep(moe_layers(trainer), mesh)
        fully_shard(trainer, mesh=mesh, ignored_params=set(expert_parameters(trainer)))
        copy_ = build_ep_rollout_copy(trainer, folder, dtype=torch.float32, device="cpu", ep_group=mesh.get_group())
        steps: list[int] = []
        firsts: list[tuple[int, int]] = []  # (call, step of the call) where a runner's bucket is first used
        call = [0]
        step = DecodeStepRunner.step

        def spy(self, slots, input_ids):
            if self.bucket_for(len(slots)) not in self.buckets:  # on CUDA: its capture, two warm-up runs first
                firsts.append((call[0], len(steps)))
            steps.append(len(slots))
            assert self.sizes == [PER_RANK * 2]  # lock-step: one bucket, the slot count, on every rank
            return step(self, slots, input_ids)

        DecodeStepRunner.step = spy  # type: ignore[method-assign]
        engine = ExpertParallelRolloutEngine(copy_, tok, EngineOptions(eos_token_ids=[-1], record_routes=True,
                                                                       cuda_graphs="on"), trainer=trainer,
                                             all_ranks_active=lambda a: any_rank(a, torch.device("cpu")))
        assert engine.cuda_graphs == "on"
        _same(_generate(engine, mine, budget), want, f"static steps, rank {rank}")
        assert len(steps) >= max(BUDGETS) - 1  # every decode step went through the static runner

        # a second call in which rank 0's longest prompt changes its cache's slot length (64 -> 128 positions: a
        # new cache and runner) and rank 1's does not: on CUDA a new runner's capture runs the step twice more,
        # collectives included, so every rank must start a new runner at the same step as the others
        call[0], steps[:] = 1, []
        longer = [RolloutPrompt(torch.randint(0, 50, (m,), generator=torch.Generator().manual_seed(3)))
                  for m in ((70, 5) if rank == 0 else (6, 4))]
        again = engine.generate(longer, SamplingParams(max_new_tokens=3, n=2, temperature=0.0)).samples
        assert all(len(s.token_ids) == 3 for s in again)
        everyone: list = [None] * WORLD
        dist.all_gather_object(everyone, firsts)
        assert everyone[0] == everyone[1], f"the ranks start new decode runners at different steps: {everyone}"

        # "auto" with a capture that fails on rank 0 only (CUDA's path, emulated: the capture's two warm-up runs on
        # the scratch rows, then the capture itself, which runs nothing; a "graph" whose replay runs the step):
        # every rank falls back to eager steps at the same step, or rank 0's all-to-alls meet rank 1's all-gathers
        auto = ExpertParallelRolloutEngine(copy_, tok, EngineOptions(eos_token_ids=[-1], record_routes=True,
                                                                     cuda_graphs="on"), trainer=trainer,
                                           all_ranks_active=lambda a: any_rank(a, torch.device("cpu")))
        kept = auto._kept_runner

        def kept_then_auto(*a):
            runner = kept(*a)
            runner.capture, auto.cuda_graphs = True, "auto"

            def capture(bucket, n, input_ids, slots):
                hint = bucket.prefix_rows.clone(), bucket.prefix_lens.clone()
                bucket.ids.fill_(runner.pad_token_id)
                bucket.slots.fill_(runner.cache.scratch_slot)
                bucket.prefix_rows.copy_(bucket.own_rows)
                bucket.prefix_lens.zero_()
                for _ in range(2):
                    runner._step(bucket)
                if rank == 0:
                    raise GraphUnsafeError("decode step could not be captured: out of memory (emulated)")
                bucket.ids[:n, 0].copy_(input_ids)
                bucket.slots[:n].copy_(torch.as_tensor(list(slots), dtype=torch.long))
                bucket.prefix_rows.copy_(hint[0])
                bucket.prefix_lens.copy_(hint[1])
                bucket.graph = SimpleNamespace(replay=lambda: setattr(bucket, "logits", runner._step(bucket)))

            runner._capture = capture
            return runner

        auto._kept_runner = kept_then_auto  # type: ignore[method-assign]
        _same(_generate(auto, mine, budget), want, f"'auto' fell back, rank {rank}")
        assert auto.cuda_graphs == "off" and auto._runner is None
    finally:
        dist.destroy_process_group()
    # Reached only when every check above passed and the group is gone. About one run in five, the interpreter's
    # own teardown in these spawned workers then aborted ("terminate called without an active exception": a C++
    # thread still joinable at exit, not one of ours; csrc starts none), after the test's work was done: the worker
    # ends here instead, so that abort cannot fail a passing test. The cause is not known yet.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_expert_parallel_rollout_in_static_steps_equals_one_process(tmp_path):
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    folder = synthesize_model_folder("tiny_qwen3_moe", tmp_path / "m", seed=0)
    mp.spawn(_rollout_worker, args=(str(tmp_path / "store2"), folder, tmp_path), nprocs=WORLD, join=True)

