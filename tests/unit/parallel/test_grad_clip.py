"""Gradient clipping (megatron_vlm.parallel.grad.clip_grad_norm_) against torch.nn.utils.clip_grad_norm_
on plain tensors: same returned norm, same clipped gradients, and no change below the threshold.
(A version that measured the norm but never scaled the gradients passed every other test.)"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.parallel.grad import clip_grad_norm_


def _params(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    ps.append(torch.nn.Parameter(torch.zeros(2)))  # no grad: ignored
    return ps


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("scale", [10.0, 0.01])
def test_matches_torch(norm_type, scale):
    ours, ref = _params(0, scale), _params(0, scale)
    before = [p.grad.clone() for p in ours[:3]]
    n_ours = clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    assert torch.allclose(n_ours, n_ref, rtol=1e-6)
    for a, b in zip(ours[:3], ref[:3]):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)
    changed = any(not torch.equal(p.grad, g) for p, g in zip(ours[:3], before))
    assert changed == (float(n_ref) > 1.0)


def test_zero_max_norm_only_measures():
    ps = _params(1, 10.0)
    before = [p.grad.clone() for p in ps[:3]]
    n = clip_grad_norm_(ps, max_norm=0.0)
    assert float(n) > 1.0
    assert all(torch.equal(p.grad, g) for p, g in zip(ps[:3], before))


def _fsdp_worker(rank: int, init_file: str) -> None:
    """FSDP2 over 2 ranks (a weight of 5 rows: uneven shards), and a Partial gradient: norm and clipped gradients
    against torch.nn.utils.clip_grad_norm_ on the whole gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1 + rank))  # each rank its own batch
        (model(x) ** 2).sum().mul(10.0).backward()
        params = list(model.parameters())
        assert all(isinstance(p.grad, DTensor) for p in params)
        full = [torch.nn.Parameter(p.detach().full_tensor()) for p in params]
        for f, p in zip(full, params):
            f.grad = p.grad.full_tensor()
        for norm_type, max_norm in ((2.0, 1.0), (float("inf"), 0.5), (1.0, 1e9)):
            before = [f.grad.clone() for f in full]
            expected = torch.nn.utils.clip_grad_norm_(full, max_norm=max_norm, norm_type=norm_type)
            total = clip_grad_norm_(params, max_norm=max_norm, norm_type=norm_type)
            torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
            for f, p in zip(full, params):
                torch.testing.assert_close(p.grad.full_tensor(), f.grad, rtol=1e-6, atol=1e-9)
            assert any(not torch.equal(f.grad, b) for f, b in zip(full, before)) == (float(expected) > max_norm)
        # a Partial gradient (pending sums: not disjoint pieces) keeps DTensor's own reduction
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Partial()]))
        local = torch.arange(4.0) + rank
        p.grad = DTensor.from_local(local, mesh, [Partial()])
        whole = torch.arange(4.0) * 2 + 1
        torch.testing.assert_close(clip_grad_norm_([p], max_norm=0.0), torch.linalg.vector_norm(whole))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp_and_partial_gradients_match_torch_on_whole_gradients(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
