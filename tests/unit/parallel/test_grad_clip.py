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
