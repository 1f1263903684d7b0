"""Routing replay under expert parallelism (parallel.ep = 2, 2 gloo processes) against the one-process block.

Each rank replays DIFFERENT recorded routes (random distinct experts per token, many on the other rank's
experts; one token unrecorded) on its own tokens through an `apply_ep` block; the one-process block replays
the concatenated routes on the concatenated tokens. Outputs, input gradients and the router's gradient
(all-reduced over the ranks) must agree, and every rank counts its own routing mismatch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.routing_replay import replaying_routes

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two spawned processes: ~35 s on a loaded CI machine

WORLD = 2
HIDDEN = 16
TOKENS = (7, 3)


def _block() -> MoE:
    moe = MoE(HIDDEN, num_experts=8, top_k=2, moe_intermediate_size=12, activation="relu2", gated_experts=False,
              score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              score_correction_bias=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe.train()


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from megatron_vlm.parallel.expert_parallel import apply_ep

        ref = _block()
        ep_block = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(n, HIDDEN, generator=g) for n in TOKENS]
        targets = [torch.randn(n, HIDDEN, generator=g) for n in TOKENS]
        routes = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])[:, None].to(torch.int8)
                  for n in TOKENS]
        routes[0][3] = -1  # an unrecorded token routes itself

        x_all = torch.cat(xs).requires_grad_(True)
        with replaying_routes(ref, torch.cat(routes)) as ref_plan:
            ref_out = ref(x_all)
            (ref_out * torch.cat(targets)).sum().backward()

        apply_ep([ep_block], dist.group.WORLD)
        x = xs[rank].clone().requires_grad_(True)
        with replaying_routes(ep_block, routes[rank]) as plan:
            out = ep_block(x)
            (out * targets[rank]).sum().backward()
        torch.testing.assert_close(out, ref_out.detach().split(list(TOKENS))[rank], rtol=0, atol=1e-5)
        torch.testing.assert_close(x.grad, x_all.grad.split(list(TOKENS))[rank], rtol=0, atol=1e-5)
        grad = ep_block.gate.weight.grad.clone()
        assert grad.abs().sum() > 0
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref.gate.weight.grad, rtol=1e-5, atol=1e-5)
        counts = torch.tensor(plan.mismatch())
        dist.all_reduce(counts)
        assert tuple(counts.tolist()) == ref_plan.mismatch() and counts[1] == sum(TOKENS) - 1
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_routing_replay_under_expert_parallelism(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)
