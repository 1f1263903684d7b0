"""DeepEP's dispatch / combine (kernels/thirdparty/deep_ep.py) on 2 GPUs against our torch all-to-all.

Skipped without deep_ep or with fewer than 2 CUDA devices. Two NCCL processes shard the experts of a
tiny bf16 block (`apply_ep`); the forward and the input / routing-weight / expert-weight gradients with
`moe_ep_dispatch = "deep_ep"` must equal those with "torch" within bf16 tolerance.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _worker(rank: int, world: int, port: int, results):
    import torch.distributed as dist

    import megatron_vlm.kernels as K
    from megatron_vlm.models.common.moe import GroupedExperts
    from megatron_vlm.parallel.expert_parallel import apply_ep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        experts = GroupedExperts(8, 256, 128, activation="silu", gated=True)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.05)
        block = torch.nn.Module()
        block.experts = experts.cuda().to(torch.bfloat16)
        apply_ep([block], dist.group.WORLD)
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(8, device="cuda", generator=g)[:2] for _ in range(64)])
        w = torch.softmax(torch.randn(64, 2, device="cuda", generator=g), -1)
        got = {}
        for backend in ("torch", "deep_ep"):
            xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            with K.use_backends({"moe_ep_dispatch": backend}):
                out, tpe = block.experts(xi, ids, wi)
            (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
            got[backend] = [out.float(), tpe.float(), xi.grad.float(), wi.grad.float()] + [
                p.grad.float().clone() for p in block.experts.parameters()]
            for p in block.experts.parameters():
                p.grad = None
        for a, b in zip(got["deep_ep"], got["torch"]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        results[rank] = "ok"
    except Exception as e:  # noqa: BLE001 - reported by the parent
        results[rank] = repr(e)
    finally:
        dist.destroy_process_group()


def test_deep_ep_dispatch_combine_equals_the_torch_all_to_all():
    pytest.importorskip("deep_ep")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, results), nprocs=2, join=True)
    assert dict(results) == {0: "ok", 1: "ok"}
