"""The torch._grouped_mm backend of `grouped_mm` against the torch reference (run on the CPU, where torch has
the op too), and its registry check: taken by `auto` only on CUDA, bf16, sm90+ (the measured configuration)."""
from __future__ import annotations

import pytest
import torch

from megatron_vlm import kernels
from megatron_vlm.kernels.reference.moe import grouped_mm as reference
from megatron_vlm.kernels.torch_fused import grouped_mm as backend

pytestmark = pytest.mark.skipif(backend.available() is not None, reason="this torch has no torch._grouped_mm")


def _case(counts, k=16, n=24, layout="enk", seed=0, tail=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + tail
    x = torch.randn(rows, k, generator=g, dtype=torch.float64).float().requires_grad_()
    shape = (len(counts), n, k) if layout == "enk" else (len(counts), k, n)
    w = (torch.randn(*shape, generator=g) / k**0.5).requires_grad_()
    return x, w, torch.tensor(counts)


@pytest.mark.parametrize("layout", ["enk", "ekn"])
@pytest.mark.parametrize("counts,tail", [([3, 0, 5, 2], 0), ([0, 4, 0, 1], 3), ([7], 0)])
def test_matches_the_reference_forward_and_backward(layout, counts, tail):
    x, w, tpe = _case(counts, layout=layout, tail=tail)
    got = backend.grouped_mm(x, w, tokens_per_expert=tpe, weight_layout=layout)
    exp = reference(x, w, tokens_per_expert=tpe, weight_layout=layout)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    if tail:  # rows past the last group: zeros
        assert got[sum(counts):].abs().max().item() == 0
    up = torch.randn_like(exp)
    g_got = torch.autograd.grad(got, (x, w), up)
    g_exp = torch.autograd.grad(exp, (x, w), up)
    for a, b in zip(g_got, g_exp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_offsets_equal_counts_and_errors_are_the_reference_ones():
    x, w, tpe = _case([2, 3, 1])
    torch.testing.assert_close(backend.grouped_mm(x, w, offsets=torch.cumsum(tpe, 0), weight_layout="enk"),
                               reference(x, w, tokens_per_expert=tpe, weight_layout="enk"))
    for kw in (dict(tokens_per_expert=tpe, offsets=tpe), dict(tokens_per_expert=torch.tensor([9, 0, 0]))):
        with pytest.raises(ValueError) as ours:
            backend.grouped_mm(x, w, weight_layout="enk", **kw)
        with pytest.raises(ValueError) as ref:
            reference(x, w, weight_layout="enk", **kw)
        assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("dtype,k,n", [(torch.float32, 10, 6), (torch.bfloat16, 12, 20), (torch.bfloat16, 16, 12)])
@pytest.mark.parametrize("layout", ["enk", "ekn"])
def test_rows_not_in_16_byte_units_take_the_reference(dtype, k, n, layout, monkeypatch):
    """torch._grouped_mm refuses K or N rows that are not whole 16-byte units ("strides should be multiple of 16
    bytes"; the tiny models' expert widths 10, 12, 20 in bf16): those calls give the reference's result instead
    of the error, and aligned ones still go to torch._grouped_mm."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w, tpe = _case([3, 0, 4], k=k, n=n, layout=layout, tail=1)
    x, w = (x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_())
    assert not backend.aligned(x, w)
    got = backend.grouped_mm(x, w, tokens_per_expert=tpe, weight_layout=layout)
    exp = reference(x, w, tokens_per_expert=tpe, weight_layout=layout)
    torch.testing.assert_close(got, exp, atol=0, rtol=0)
    up = torch.randn_like(exp)
    for a, b in zip(torch.autograd.grad(got, (x, w), up), torch.autograd.grad(exp, (x, w), up)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not calls
    x16, w16, _ = _case([3, 0, 4], k=16, n=24, layout=layout, tail=1)
    backend.grouped_mm(x16.to(dtype), w16.to(dtype), tokens_per_expert=tpe, weight_layout=layout)
    assert calls


def test_no_rows_in_any_group_gives_zeros():
    x, w, _ = _case([1, 1])
    out = backend.grouped_mm(x, w, tokens_per_expert=torch.tensor([0, 0]), weight_layout="enk")
    assert out.shape == (2, 24) and out.abs().max().item() == 0


def test_check_takes_only_the_measured_configuration(monkeypatch):
    assert "cpu" in backend.cuda_check("cpu", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert backend.cuda_check("cuda", torch.bfloat16) is None
    assert "bfloat16" in backend.cuda_check("cuda", torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "9.0" in backend.cuda_check("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 4))  # an MI300 under ROCm
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert "ROCm" in backend.cuda_check("cuda", torch.bfloat16)


def test_forced_through_the_registry_on_cpu_is_refused_with_the_reason():
    x, w, tpe = _case([2, 2])
    with kernels.use_backends({"grouped_mm": "torch_grouped_mm"}), pytest.raises(Exception, match="chosen only on cuda"):
        kernels.grouped_mm(x, w, tokens_per_expert=tpe, weight_layout="enk")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["enk", "ekn"])
@pytest.mark.parametrize("k,n", [(96, 136), (20, 12)])
def test_bf16_cuda_matches_the_reference_through_auto(layout, k, n):
    """On the GPU, in bf16, through `auto` (torch._grouped_mm on sm90+, Triton before): forward and gradients
    against the reference's per-expert matmuls in fp32, also for a tiny model's widths (20 / 12: not whole
    16-byte rows, which torch._grouped_mm refuses; the backend hands them to the reference)."""
    x, w, tpe = _case([0, 70, 3, 200, 1], k=k, n=n, layout=layout, tail=5)
    xb, wb = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (x, w))
    got = kernels.grouped_mm(xb, wb, tokens_per_expert=tpe.cuda(), weight_layout=layout)
    xf, wf = (t.detach().float().requires_grad_() for t in (xb, wb))
    exp = reference(xf, wf, tokens_per_expert=tpe.cuda(), weight_layout=layout)
    torch.testing.assert_close(got.float(), exp, atol=2e-2, rtol=2e-2)
    up = torch.randn(exp.shape, generator=torch.Generator().manual_seed(1)).cuda()
    g_got = torch.autograd.grad(got, (xb, wb), up.bfloat16())
    g_exp = torch.autograd.grad(exp, (xf, wf), up.bfloat16().float())
    for a, b in zip(g_got, g_exp):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=2e-2)
