"""The Liger-Kernel adapter (`kernels/thirdparty/liger.py`) for `linear_token_logprobs`.

On the CPU: (1) against a stand-in of `liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`
written from its documented interface (reduction "none": -log p per token, 0 at `ignore_index`); (2) when
liger-kernel is installed (the dev extra installs it), against the real package, whose Triton kernels run
on the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA). Both
must give our reference's log-probs; calls with entropy or with gradients run the reference (logged),
and `auto` never picks it.

`rms_norm` / `swiglu` (CUDA only: Liger's norm / SwiGLU kernels do not run in the interpreter): against a
stand-in of `liger_rms_norm(X, W, eps, offset, casting_mode, in_place)` ("llama": x cast to its dtype
before the weight; "gemma": all fp32, (offset + W)), `liger_fused_add_rms_norm(X, R, W, eps, ...)` ->
(Y, X + R) and `liger_swiglu(a, b)`; they must give the references' numbers (bf16 rms_norm bit for bit,
which the "llama" mode would not), and forcing them on the CPU is refused with the reason."""
from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest
import torch
from kernel_checks import DEVICE

from megatron_vlm import kernels
from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as reference
from megatron_vlm.kernels.thirdparty import liger as adapter


def _inputs(n=12, h=16, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.fixture
def fake(monkeypatch):
    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, **kw):
        assert reduction == "none"
        calls.append((ignore_index, input.requires_grad or weight.requires_grad))
        logits = (input.double() @ weight.double().t())
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
        return loss.to(input.dtype)

    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    adapter._logged.clear()
    return calls


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_no_grad_logprobs_match_the_reference(fake, temperature):
    hidden, weight, labels = _inputs()
    weight.requires_grad_()  # a trainer's parameter under no_grad: detached before Liger sees it
    with torch.no_grad():
        ours = adapter.linear_token_logprobs(hidden, weight, labels, temperature=temperature)
        ref = reference(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(ours, ref)
    assert ours.dtype == torch.float32 and bool((ours[labels == -100] == 0).all())
    assert fake == [(-100, False)]  # detached: Liger computes no gradients under no_grad


def test_entropy_and_old_releases_gradients_fall_back_and_say_why(fake, caplog, monkeypatch):
    hidden, weight, labels = _inputs()
    hidden.requires_grad_()
    monkeypatch.setattr(adapter, "_per_token_backward", lambda: False)  # as liger-kernel < 0.8.5
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        with torch.no_grad():
            logp, ent = adapter.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
        with_grad = adapter.linear_token_logprobs(hidden, weight, labels)
    ref_logp, ref_ent = reference(hidden.detach(), weight, labels, return_entropy=True)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    assert with_grad.requires_grad  # the reference's autograd path
    assert fake == []
    assert "entropy" in caplog.text and "one scalar" in caplog.text


def test_graded_calls_reach_liger_from_0_8_5(fake, monkeypatch):
    monkeypatch.setattr(adapter, "_per_token_backward", lambda: True)
    hidden, weight, labels = _inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    w = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(5))
    ours = adapter.linear_token_logprobs(hidden, weight, labels, temperature=0.8)
    grads = torch.autograd.grad((ours * w).sum(), (hidden, weight))
    ref = reference(hidden, weight, labels, temperature=0.8)
    grads_ref = torch.autograd.grad((ref * w).sum(), (hidden, weight))
    torch.testing.assert_close(ours, ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)
    assert fake == [(-100, True)]


def test_auto_never_picks_it(fake):
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        for device in ("cpu", "cuda"):
            assert DEFAULT_REGISTRY.choose("linear_token_logprobs", device, torch.bfloat16) != "liger"
    finally:
        DEFAULT_REGISTRY.clear_cache()


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed (dev extra)")
def test_real_package_through_the_registry_matches_the_reference():
    # on the device the kernels run on: compiled on CUDA, interpreted on the CPU
    hidden, weight, labels = (t.to(DEVICE) for t in _inputs(n=10, h=32, v=50, seed=1))
    adapter._logged.clear()
    with torch.no_grad(), kernels.use_backends({"linear_token_logprobs": "liger"}):
        ours = kernels.linear_token_logprobs(hidden, weight, labels, temperature=0.9)
    torch.testing.assert_close(ours, reference(hidden, weight, labels, temperature=0.9), atol=1e-5, rtol=1e-5)
    # per-token upstream gradients (GRPO advantages): the installed release applies them per token
    hidden.requires_grad_()
    weight.requires_grad_()
    w = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with kernels.use_backends({"linear_token_logprobs": "liger"}):
        ours = kernels.linear_token_logprobs(hidden, weight, labels, temperature=0.9)
    grads = torch.autograd.grad((ours * w).sum(), (hidden, weight))
    grads_ref = torch.autograd.grad((reference(hidden, weight, labels, temperature=0.9) * w).sum(), (hidden, weight))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_real_package_on_gpu_bf16():
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hidden, weight, labels = (t.cuda() for t in _inputs(n=4096, h=1024, v=32000))
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(adapter.linear_token_logprobs(hidden, weight, labels),
                                   reference(hidden, weight, labels), atol=5e-2, rtol=2e-2)


@pytest.fixture
def fake_norms(monkeypatch):
    calls = []

    def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls.append(("rms_norm", casting_mode, offset, in_place))
        xf = X.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if casting_mode == "llama":
            return normed.to(X.dtype) * (offset + W)
        return (normed * (offset + W.float())).to(X.dtype)

    def liger_fused_add_rms_norm(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls.append(("fused_add_rms_norm", casting_mode))
        s = X + R
        return liger_rms_norm(s, W, eps, offset, casting_mode, in_place), s

    def liger_swiglu(a, b):
        calls.append(("swiglu",))
        return (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)

    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    functional = types.ModuleType("liger_kernel.transformers.functional")
    for fn in (liger_rms_norm, liger_fused_add_rms_norm, liger_swiglu):
        setattr(functional, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_with_and_without_residual(fake_norms, dtype):
    from megatron_vlm.kernels.reference.norms import rms_norm as ref_rms_norm

    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(3, 5, 16, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.5 * torch.randn(16, generator=g)).to(dtype)
    torch.testing.assert_close(adapter.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), rtol=0, atol=0)
    out, summed = adapter.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_summed = ref_rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    assert fake_norms == [("rms_norm", "gemma", 0.0, False), ("fused_add_rms_norm", "gemma"),
                          ("rms_norm", "gemma", 0.0, False)]
    with pytest.raises(ValueError, match="does not match hidden size"):
        adapter.rms_norm(x, w[:8], 1e-6)


def test_swiglu_matches_the_reference(fake_norms):
    from megatron_vlm.kernels.reference.swiglu import swiglu as ref_swiglu

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    torch.testing.assert_close(adapter.swiglu(a, b), ref_swiglu(a, b))
    assert fake_norms == [("swiglu",)]


def test_norm_and_swiglu_are_forced_only_and_refused_off_cuda(fake_norms):
    registry = kernels.DEFAULT_REGISTRY
    registry.clear_cache()
    try:
        for op in ("rms_norm", "swiglu"):
            assert registry.choose(op, "cuda", torch.bfloat16) != "liger"  # no auto until measured
            with kernels.use_backends({op: "liger"}):
                assert registry.choose(op, "cuda", torch.bfloat16) == "liger"
                with pytest.raises(kernels.BackendUnavailableError, match="liger_kernel needs a cuda tensor"):
                    registry.choose(op, "cpu", torch.float32)
    finally:
        registry.clear_cache()

