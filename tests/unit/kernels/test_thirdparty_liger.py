"""The Liger-Kernel adapters (`kernels/thirdparty/liger.py`).

On the CPU (always): the adapters run against a stand-in `liger_kernel.transformers.functional` written
here from Liger's documented functional interface — `liger_fused_linear_cross_entropy(input, weight,
target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
return_z_loss, accum_dtype, ...)` (reduction "none": fp32 per-token -log p, 0 at ignore_index),
`liger_rms_norm(X, W, eps, offset, casting_mode, in_place)` ("llama": x cast to its dtype before the
weight; "gemma": all fp32, (offset + W)), `liger_fused_add_rms_norm(X, R, W, eps, ...)` -> (Y, X + R),
`liger_swiglu(a, b)` — and must give our references' numbers (bf16 rms_norm too, which the "llama"
mode would not), with the entropy fallback logged. Liger 0.8 does not import on a CPU-only Triton,
so the real package is tested only on a GPU (tests/gpu/test_thirdparty_liger.py).
"""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_vlm.kernels.reference.norms import rms_norm as ref_rms_norm
from megatron_vlm.kernels.reference.swiglu import swiglu as ref_swiglu
from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as ref_logprobs
from megatron_vlm.kernels.thirdparty import liger as adapter


def _fake_functional(calls):
    f = types.ModuleType("liger_kernel.transformers.functional")

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                         return_token_accuracy=False, return_predicted_tokens=False, chunk_mem_const=1):
        assert target.dtype == torch.int64 and bias is None and softcap is None and label_smoothing == 0.0
        calls.append(("flce", reduction, ignore_index))
        logits = (input @ weight.t()).float()
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
        return loss if reduction == "none" else loss.sum()

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
        return (F.silu(a.float()) * b.float()).to(a.dtype)

    for fn in (liger_fused_linear_cross_entropy, liger_rms_norm, liger_fused_add_rms_norm, liger_swiglu):
        setattr(f, fn.__name__, fn)
    return f


@pytest.fixture
def calls(monkeypatch):
    log = []
    functional = _fake_functional(log)
    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.functional = functional
    pkg = types.ModuleType("liger_kernel")
    pkg.transformers = transformers
    for name, mod in (("liger_kernel", pkg), ("liger_kernel.transformers", transformers),
                      ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, mod)
    adapter._logged.clear()
    return log


def _lm(n=6, h=8, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[2] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_token_logprobs_and_grads_match_the_reference(calls, temperature):
    hidden, weight, labels = _lm()
    ours = adapter.linear_token_logprobs(hidden, weight, labels.to(torch.int32), temperature=temperature)
    ours.sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref = ref_logprobs(hidden, weight, labels, temperature=temperature)
    ref.sum().backward()
    torch.testing.assert_close(ours, ref)
    assert ours.dtype == torch.float32 and ours[2] == 0
    # both compute the softmax in fp32 (different op order): fp32 tolerance on the gradients
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-5, atol=1e-6)
    assert calls == [("flce", "none", -100)]


def test_linear_token_logprobs_entropy_falls_back_and_bad_labels_are_refused(calls, caplog):
    hidden, weight, labels = _lm()
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        lp, ent = adapter.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
    ref_lp, ref_ent = ref_logprobs(hidden, weight, labels, return_entropy=True)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    assert calls == [] and "returns none" in caplog.text
    with pytest.raises(ValueError, match="label 11 outside"):
        adapter.linear_token_logprobs(hidden, weight, torch.full_like(labels, 11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_with_and_without_residual(calls, dtype):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(3, 5, 16, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.5 * torch.randn(16, generator=g)).to(dtype)
    torch.testing.assert_close(adapter.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), rtol=0, atol=0)
    out, summed = adapter.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_summed = ref_rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    assert calls == [("rms_norm", "gemma", 0.0, False), ("fused_add_rms_norm", "gemma"), ("rms_norm", "gemma", 0.0, False)]
    with pytest.raises(ValueError, match="does not match hidden size"):
        adapter.rms_norm(x, w[:8], 1e-6)


def test_swiglu_matches_the_reference(calls):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    torch.testing.assert_close(adapter.swiglu(a, b), ref_swiglu(a, b))
    assert calls == [("swiglu",)]


def test_liger_is_forced_only_and_refused_where_it_cannot_run(calls):
    import megatron_vlm.kernels as K
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        for op in ("linear_token_logprobs", "rms_norm", "swiglu"):
            assert DEFAULT_REGISTRY.choose(op, "cuda", torch.bfloat16) != "liger"  # no auto until measured
            with K.use_backends({op: "liger"}):
                assert DEFAULT_REGISTRY.choose(op, "cuda", torch.bfloat16) == "liger"
                with pytest.raises(K.BackendUnavailableError, match="liger_kernel needs a cuda tensor"):
                    DEFAULT_REGISTRY.choose(op, "cpu", torch.float32)
    finally:
        DEFAULT_REGISTRY.clear_cache()
