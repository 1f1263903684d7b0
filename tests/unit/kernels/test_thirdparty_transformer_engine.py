"""The Transformer Engine adapter (`kernels/thirdparty/transformer_engine.py`), on the CPU.

The adapter runs against stand-ins of `transformer_engine_torch` and `transformer_engine.pytorch` that
compute in float64 the plain way (per sequence, per head; norms through autograd) and make the checks the
real package makes (read in TE 2.9, the same in 2.0-2.18; each check below names its source), so that a call
the real package would refuse fails here:

- norms (`pytorch/csrc/extensions/normalization.cpp`, `common/normalization/rmsnorm/rmsnorm_api.cpp`,
  `layernorm/ln_api.cpp`, `common.h` `TeNormalizationRegistry::getKernel`, `*_cuda_kernel.cu` registrations,
  `common/transformer_engine.cpp` `CheckInputTensor`, `pytorch/constants.py` `TE_DType`): the pybind
  signatures `rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)` ->
  [y, None, rsigma fp32 [N]], `layernorm_fwd(input, weight, bias, eps, ...)` -> [y, mu fp32, rsigma fp32],
  `rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zcg)` -> [dx, dgamma], `layernorm_bwd(dz, x, mu, rsigma,
  gamma, sm_margin, zcg)` -> [dx, dgamma, dbeta]; x 2-D and allocated, weight `[H]`, beta of gamma's shape
  and dtype, eps >= 0, a kernel registered for the (weight, input, output) dtypes, dz of gamma's dtype;
  the forward reads x / weight / bias by pointer (no `.contiguous()` there), so they must be contiguous;
- attention (`pytorch/attention/dot_product_attention/dot_product_attention.py` `DotProductAttention`,
  `utils.py` `check_set_window_size` / `get_qkv_layout` / `get_attention_backend`,
  `common/fused_attn/fused_attn.cpp` `nvte_get_fused_attn_backend`): heads divisible by the GQA groups,
  q / k / v of one dtype with the module's heads and head dim, last-dim stride 1, a known mask type, the
  window table, thd with a "padding" type and int32 1-D cu_seqlens of one shape, and the backend choice
  modelled for an H100 with recent cuDNN, flash-attn not installed unless asked: the fused backend (fp16 /
  bf16, head dim % 8 == 0 and <= 256, windows only (left, 0) with causal types, bottom-right causal with
  Sq <= Sk), flash-attn (fp16 / bf16, head dim % 8 == 0 and <= 256), the unfused one (bshd only); none ->
  TE's ValueError. Masks: top-left causal unless "bottom_right" is named; output `[T, H * D]` /
  `[B, S, H * D]`.

The adapter must give our references' values and gradients; unsupported calls must fall back (logged, the
stand-in never called). The real package against the references: tests/gpu/test_gpu_thirdparty_transformer_engine.py.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest
import torch

from megatron_vlm import kernels as K
from megatron_vlm.kernels.reference import norms as ref_norms
from megatron_vlm.kernels.reference.attention import attention as ref_attention
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY
from megatron_vlm.kernels.thirdparty import transformer_engine as adapter

# pytorch/constants.py TE_DType (the float8 keys left out): no float64
_TE_DTYPE = {torch.uint8: "kByte", torch.int32: "kInt32", torch.float32: "kFloat32", torch.float16: "kFloat16",
             torch.bfloat16: "kBFloat16"}
_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# the (weight, input, output) dtypes with a registered TE kernel (common/normalization/*/…_cuda_kernel.cu,
# REGISTER_NORM_LAUNCHER; the fp8 outputs left out); else getKernel: "Unavailable kernel for this normalization config."
_NORM_FWD_KERNELS = {(_F32, _F32, _F32), (_F16, _F16, _F16), (_BF16, _BF16, _BF16), (_F32, _F32, _F16), (_F32, _F32, _BF16)}
# backward: (weight, input), the output of the weight's dtype
_NORM_BWD_KERNELS = {(_F32, _F32), (_F16, _F16), (_BF16, _BF16), (_F16, _F32), (_BF16, _F32)}
# pytorch/constants.py AttnMaskTypes
_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right",
               "arbitrary")
_NO_BACKEND = ("No dot product attention backend is available for the provided inputs. Please run with NVTE_DEBUG=1 "
               "NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all backends.")


def _norm_forward(x, w, b, eps, kind):
    if kind == "rms":
        rsigma = torch.rsqrt(x.pow(2).mean(-1) + eps)
        return x * rsigma[:, None] * w, None, rsigma
    mu = x.mean(-1)
    rsigma = torch.rsqrt((x - mu[:, None]).pow(2).mean(-1) + eps)
    y = (x - mu[:, None]) * rsigma[:, None] * w
    return (y if b is None else y + b), mu, rsigma


def _fake_tex(calls):
    tex = types.ModuleType("transformer_engine_torch")

    def check_fwd(x, w, eps, ln_out, quantizer, otype, sm_margin, zcg):
        # normalization.cpp rmsnorm_fwd / layernorm_fwd: input and weight go to makeTransformerEngineTensor
        # as they are (data pointer + sizes, no .contiguous()); the output and rsigma / mu are allocated there
        assert x.is_contiguous() and w.is_contiguous(), "TE would read a strided tensor as if it were contiguous"
        assert otype in _TE_DTYPE.values(), otype  # a tex.DType
        assert ln_out is None and quantizer is None and sm_margin == 0 and zcg is False
        # rmsnorm_api.cpp rmsnorm_fwd / ln_api.cpp layernorm_fwd
        assert x.dim() == 2, "x must be 2D tensor."
        assert w.shape == (x.shape[1],), "Gamma must have the same hidden size."
        assert eps >= 0, "Epsilon must be non-negative."
        assert x.numel() > 0, "Input x is not allocated!"  # transformer_engine.cpp CheckInputTensor
        otype_torch = {v: k for k, v in _TE_DTYPE.items()}[otype]
        assert (w.dtype, x.dtype, otype_torch) in _NORM_FWD_KERNELS, "Unavailable kernel for this normalization config."
        return otype_torch

    def fwd(kind, x, w, b, eps, otype):
        y, mu, rsigma = _norm_forward(x.double(), w.double(), None if b is None else b.double(), eps, kind)
        return y.to(otype), None if mu is None else mu.float(), rsigma.float()

    def check_bwd(dz, x, mu, rsigma, gamma, sm_margin, zcg):
        # normalization.cpp *_bwd make dz / x / mu / rsigma / gamma contiguous themselves; rmsnorm_api.cpp
        # rmsnorm_bwd / ln_api.cpp layernorm_bwd
        assert dz.dtype == gamma.dtype and rsigma.dtype == torch.float32
        assert x.dim() == 2 and dz.shape == x.shape and gamma.shape[0] == x.shape[1]
        assert rsigma.shape == (x.shape[0],)
        if mu is not None:
            assert mu.dtype == torch.float32 and mu.shape == rsigma.shape
        assert (gamma.dtype, x.dtype) in _NORM_BWD_KERNELS, "Unavailable kernel for this normalization config."
        assert sm_margin == 0 and zcg is False

    def bwd(kind, dz, x, rsigma, gamma):
        with torch.enable_grad():  # called from an autograd backward, where grad mode is off
            xd = x.double().requires_grad_()
            wd = gamma.double().requires_grad_()
            bd = torch.zeros_like(wd, requires_grad=True)
            y, _, rs2 = _norm_forward(xd, wd, bd if kind == "ln" else None, _eps[0], kind)
            grads = torch.autograd.grad(y, (xd, wd, bd) if kind == "ln" else (xd, wd), dz.double())
        torch.testing.assert_close(rs2.float(), rsigma)  # the saved statistics are the forward's
        return [grads[0].to(x.dtype), *(g.to(gamma.dtype) for g in grads[1:])]  # dx in x's dtype, dgamma / dbeta in gamma's

    _eps = [None]

    def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
        out_dtype = check_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)
        calls.append("rmsnorm_fwd")
        _eps[0] = eps
        return list(fwd("rms", input, weight, None, eps, out_dtype))

    def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
        check_bwd(dz, x, None, rsigma, gamma, sm_margin, zero_centered_gamma)
        calls.append("rmsnorm_bwd")
        return bwd("rms", dz.contiguous(), x.contiguous(), rsigma, gamma.contiguous())

    def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
        out_dtype = check_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)
        # ln_api.cpp layernorm_fwd: an absent bias is an empty tensor there (shape {}), refused by these
        assert bias is not None and bias.shape == weight.shape, "Gamma and Beta must have the same shape."
        assert bias.dtype == weight.dtype, "Gamma and Beta must have the same dtype."
        assert bias.is_contiguous()
        calls.append("layernorm_fwd")
        _eps[0] = eps
        return list(fwd("ln", input, weight, bias, eps, out_dtype))

    def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
        check_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma)
        calls.append("layernorm_bwd")
        return bwd("ln", dz.contiguous(), x.contiguous(), rsigma, gamma.contiguous())

    tex.rmsnorm_fwd, tex.rmsnorm_bwd = rmsnorm_fwd, rmsnorm_bwd
    tex.layernorm_fwd, tex.layernorm_bwd = layernorm_fwd, layernorm_bwd
    return tex


def _attend_one(q, k, v, scale, mask_type, window):
    """q [Sq, Hq, D], k / v [Sk, Hkv, D] -> [Sq, Hq * D]: TE's documented masking, computed plainly."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    shift = sk - sq if ("bottom_right" in mask_type or "causal" not in mask_type) else 0
    left, right = window
    out = torch.zeros(sq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)].double(), v[:, h // (hq // hkv)].double()
        for i in range(sq):
            c = i + shift
            keys = [j for j in range(sk) if (left < 0 or j >= c - left) and (right < 0 or j <= c + right)]
            if keys:
                p = torch.softmax(torch.stack([(q[i, h].double() @ kh[j]) * scale for j in keys]), 0)
                out[i, h] = (p[:, None] * vh[keys]).sum(0)
    return out.reshape(sq, hq * d)


def _check_set_window_size(mask_type, window):
    """utils.py check_set_window_size, strict: where TE would rewrite the window with a warning
    ((-1, -1) or (>= 0, != 0) for causal types, (-1, 0) for the others) the stand-in refuses too."""
    if "causal" in mask_type:
        assert window[1] == 0 and window[0] >= -1, f"window_size should be (-1, 0) or (>=0, 0) for {mask_type}"
    else:
        assert mask_type in ("no_mask", "padding", "arbitrary"), "Invalid attn_mask_type: " + mask_type
        assert window == (-1, -1) or min(window) >= 0, f"window_size should be (-1, -1) or (>=0, >=0) for {mask_type}"


def _backend_available(qkv_format, dtype, head_dim, mask_type, window, max_q, max_k, flash_attn):
    """utils.py get_attention_backend + fused_attn.cpp nvte_get_fused_attn_backend, for an H100 (sm90) with
    cuDNN >= 9.7: is any of the three backends left?"""
    half = dtype in (torch.float16, torch.bfloat16)
    dims = head_dim % 8 == 0 and head_dim <= 256
    windowed = window not in ((-1, -1), (-1, 0))
    fused = half and dims and (not windowed or (window[1] == 0 and "causal" in mask_type and max_q <= max_k))
    if "bottom_right" in mask_type and max_q > max_k:
        fused = False
    flash = flash_attn and half and dims
    unfused = qkv_format != "thd"  # "Disabling UnfusedDotProductAttention for qkv_format = thd"
    return fused or flash or unfused


def _fake_te(calls, version="2.9.0", flash_attn=False):
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    pt = types.ModuleType("transformer_engine.pytorch")
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = dict(_TE_DTYPE)

    class DotProductAttention:
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", window_size=None, attention_type="self",
                     softmax_scale=None):
            num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
            assert num_attention_heads % num_gqa_groups == 0, "The number of attention heads must be divisible by the number of GQA groups!"
            assert attention_type in ("self", "cross"), f"attention_type {attention_type} not supported"
            assert attention_dropout == 0.0
            self.cross = attention_type == "cross"
            self.heads, self.head_dim, self.groups, self.qkv_format = num_attention_heads, kv_channels, num_gqa_groups, qkv_format
            self.scale = kv_channels ** -0.5 if softmax_scale is None else softmax_scale
            calls.append(("init", num_attention_heads, num_gqa_groups, qkv_format, attention_type))

        def __call__(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                     cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None):
            q, k, v = query_layer, key_layer, value_layer
            # DotProductAttention.forward ("checks for q/k/v shapes"; is_cuda is not checkable here)
            assert q.dtype == k.dtype == v.dtype, "Queries, keys and values must have the same data type!"
            assert k.shape[:-1] == v.shape[:-1]
            assert q.shape[-2] == self.heads and k.shape[-2] == self.groups
            assert q.shape[-1] == k.shape[-1] == self.head_dim and v.shape[-1] == self.head_dim
            assert attention_mask is None
            assert attn_mask_type in _MASK_TYPES, f"Attention mask type {attn_mask_type} is not supported!"
            window = tuple(window_size) if window_size is not None else None
            assert window is not None, "the adapter always names the window"
            _check_set_window_size(attn_mask_type, window)
            assert qkv_format in ("sbhd", "bshd", "thd")
            if not self.cross:  # self-attention: one set of lengths (stricter than TE)
                assert q.shape[:-2] == k.shape[:-2] and (cu_seqlens_q is None or torch.equal(cu_seqlens_q, cu_seqlens_kv))
            if qkv_format == "bshd":
                assert q.dim() == k.dim() == v.dim() == 4, "Queries, keys and values must be 4D tensors"
                assert "padding" not in attn_mask_type  # the adapter gives no attention_mask / cu_seqlens there
                max_q, max_k = q.shape[1], k.shape[1]
            else:
                assert qkv_format == "thd" and q.dim() == k.dim() == v.dim() == 3, "must be 3D tensors when qkv_format = thd!"
                assert "padding" in attn_mask_type, "Attention mask type must be padding or padding_causal for qkv_format=thd!"
                assert cu_seqlens_q is not None and cu_seqlens_kv is not None
                assert cu_seqlens_q.shape == cu_seqlens_kv.shape and cu_seqlens_q.dim() == 1, "must both have shape [batch_size + 1]!"
                assert cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32, "must both be in dtype torch.int32!"
                # the fused / flash kernels read them on q's device by pointer
                assert cu_seqlens_q.device == q.device and cu_seqlens_q.is_contiguous() and cu_seqlens_kv.is_contiguous()
                max_q, max_k = max_seqlen_q, max_seqlen_kv
            # utils.py get_qkv_layout
            assert all(t.stride(-1) == 1 for t in (q, k, v)), "q, k and v must have stride 1 in their last dimension!"
            if not _backend_available(qkv_format, q.dtype, q.shape[-1], attn_mask_type, window, max_q, max_k, flash_attn):
                raise ValueError(_NO_BACKEND)
            calls.append((qkv_format, attn_mask_type, window))
            if qkv_format == "bshd":
                return torch.stack([_attend_one(q[b], k[b], v[b], self.scale, attn_mask_type, window)
                                    for b in range(q.shape[0])]).to(q.dtype)
            parts = []
            for s in range(cu_seqlens_q.numel() - 1):
                a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
                c, e = int(cu_seqlens_kv[s]), int(cu_seqlens_kv[s + 1])
                assert b - a <= max_seqlen_q and e - c <= max_seqlen_kv
                parts.append(_attend_one(q[a:b], k[c:e], v[c:e], self.scale, attn_mask_type, window))
            return torch.cat(parts).to(q.dtype)

    pt.DotProductAttention = DotProductAttention
    pt.constants = constants
    te.pytorch = pt
    return {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.pytorch.constants": constants}


def _install(monkeypatch, version="2.9.0", flash_attn=False):
    calls: list = []
    for name, mod in {**_fake_te(calls, version, flash_attn), "transformer_engine_torch": _fake_tex(calls)}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    adapter._logged.clear()
    adapter._modules.clear()
    DEFAULT_REGISTRY.clear_cache()
    return calls


@pytest.fixture
def fake(monkeypatch):
    yield _install(monkeypatch)
    adapter._modules.clear()
    DEFAULT_REGISTRY.clear_cache()


def _r(*shape, seed=0, grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


# the norm references compute in fp32; the stand-ins in fp64 from the fp32 inputs
_NORM_TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(out, inputs):
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
    return torch.autograd.grad(loss, [t for t in inputs if t is not None])


def test_rms_norm_values_and_gradients_match_the_reference(fake):
    x, r, w = _r(2, 3, 16, seed=1), _r(2, 3, 16, seed=2), _r(16, seed=3)
    for kwargs, inputs in (({}, (x, w)), ({"residual": r}, (x, r, w))):
        ours = adapter.rms_norm(x, w, 1e-5, **kwargs)
        ref = ref_norms.rms_norm(x, w, 1e-5, **kwargs)
        torch.testing.assert_close(ours, ref, **_NORM_TOL)
        for a, b in zip(_grads(ours, inputs), _grads(ref, inputs)):
            torch.testing.assert_close(a, b, **_NORM_TOL)
    assert fake.count("rmsnorm_fwd") == 2 and fake.count("rmsnorm_bwd") == 2


def test_rms_norm_weight_of_another_dtype_is_cast_and_gets_its_gradient(fake):
    x, w = _r(5, 8, seed=4, dtype=torch.bfloat16), _r(8, seed=5)
    ours = adapter.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(ours, ref_norms.rms_norm(x, w.bfloat16(), 1e-6), rtol=1e-2, atol=1e-2)
    (gw,) = torch.autograd.grad(ours.float().sum(), w)
    assert ours.dtype == torch.bfloat16 and gw.dtype == torch.float32 and gw.abs().sum() > 0
    assert fake == ["rmsnorm_fwd", "rmsnorm_bwd"]


def test_strided_weight_and_rows_reach_te_contiguous(fake):
    """TE's forward reads x, the weight and the bias through their data pointers: a strided weight (a view
    of a larger parameter) and a transposed x are copied first (the stand-in refuses strided tensors)."""
    big = _r(2, 16, seed=6)
    w, b = big[0, ::2], big[1, ::2]  # stride 2
    x = _r(8, 6, seed=7).t()  # [6, 8], not contiguous
    assert not w.is_contiguous() and not x.is_contiguous()
    torch.testing.assert_close(adapter.rms_norm(x, w, 1e-6), ref_norms.rms_norm(x, w, 1e-6), **_NORM_TOL)
    torch.testing.assert_close(adapter.layer_norm(x, w, b, 1e-6), ref_norms.layer_norm(x, w, b, 1e-6), **_NORM_TOL)
    assert fake == ["rmsnorm_fwd", "layernorm_fwd"]


def test_rms_norm_residual_of_another_dtype_is_summed_in_xs_dtype(fake):
    x, r, w = _r(3, 16, seed=8, dtype=torch.float16), _r(3, 16, seed=9), _r(16, seed=10, dtype=torch.float16)
    out, summed = adapter.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_summed = ref_norms.rms_norm(x, w, 1e-6, residual=r)
    assert summed.dtype == out.dtype == torch.float16
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("weight,bias", [(True, True), (False, False), (True, False), (False, True)])
def test_layer_norm_values_and_gradients_match_the_reference(fake, weight, bias):
    """TE's layernorm_fwd refuses an absent bias ("Gamma and Beta must have the same shape"): the adapter
    gives zeros, and ones for an absent weight."""
    x = _r(4, 24, seed=6)
    w = _r(24, seed=7) if weight else None
    b = _r(24, seed=8) if bias else None
    ours, ref = adapter.layer_norm(x, w, b, 1e-5), ref_norms.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(ours, ref, **_NORM_TOL)
    for a, c in zip(_grads(ours, (x, w, b)), _grads(ref, (x, w, b))):
        torch.testing.assert_close(a, c, **_NORM_TOL)
    assert fake == ["layernorm_fwd", "layernorm_bwd"]


def test_norm_fallbacks_are_logged_and_skip_the_package(monkeypatch, caplog):
    calls = _install(monkeypatch)
    x, w = _r(3, 12, seed=9), _r(12, seed=10)
    x64, w64 = _r(3, 16, seed=11, dtype=torch.float64), _r(16, seed=12, dtype=torch.float64)
    empty, w16 = _r(0, 16, seed=13), _r(16, seed=14)
    xe = _r(3, 16, seed=15)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        torch.testing.assert_close(adapter.rms_norm(x, w, 1e-5), ref_norms.rms_norm(x, w, 1e-5))
        torch.testing.assert_close(adapter.rms_norm(x64, w64, 1e-5), ref_norms.rms_norm(x64, w64, 1e-5))
        torch.testing.assert_close(adapter.layer_norm(empty, w16, None, 1e-5), ref_norms.layer_norm(empty, w16, None, 1e-5))
        torch.testing.assert_close(adapter.rms_norm(xe, w16, -1e-6), ref_norms.rms_norm(xe, w16, -1e-6))
        old = _install(monkeypatch, version="2.0.1")
        x16 = _r(3, 16, seed=11)
        torch.testing.assert_close(adapter.layer_norm(x16, None, None, 1e-5), ref_norms.layer_norm(x16, None, None, 1e-5))
    assert calls == [] and old == []
    for reason in ("hidden size 12", "dtype torch.float64", "an empty input", "eps -1e-06", "transformer_engine 2.0.1"):
        assert reason in caplog.text, reason
    DEFAULT_REGISTRY.clear_cache()


def _packed(lengths_q, lengths_k, hq=4, hkv=2, d=8, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def _exact(q, k, v, **kw):
    """The reference in float64, rounded to q's dtype as TE's output is."""
    return ref_attention(q.double(), k.double(), v.double(), **kw).to(q.dtype)


_HALF_TOL = dict(rtol=2e-3, atol=2e-3)  # one fp16 rounding of outputs of magnitude < 3
_SDPA_TOL = dict(rtol=1e-2, atol=1e-2)  # torch SDPA in fp16 on the CPU


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, -1))])
def test_packed_thd_translation_matches_the_reference(fake, causal, window):
    q, k, v, cu, _ = _packed([1, 6, 9], [1, 6, 9])
    got = adapter.attention(q, k, v, causal=causal, cu_seqlens_q=cu, window=window, softmax_scale=0.3)
    torch.testing.assert_close(got, _exact(q, k, v, causal=causal, cu_seqlens_q=cu, window=window, softmax_scale=0.3), **_HALF_TOL)
    assert fake[0] == ("init", 4, 2, "thd", "self")
    assert fake[-1][:2] == ("thd", "padding_causal_bottom_right" if causal else "padding")


@pytest.mark.parametrize("bad", [[0, 9, 3, 16], [0, 4, 12], [2, 4, 16], [0, 4, 20]])
def test_bad_cu_seqlens_raise_before_te(fake, bad):
    """Without max_seqlen hints the adapter reads the lengths on the host; that read also checks cu_seqlens (the
    ValueError of the other backends), so TE never gets decreasing / shifted / short ones."""
    q, k, v, _, _ = _packed([1, 6, 9], [1, 6, 9])
    with pytest.raises(ValueError, match="cu_seqlens"):
        adapter.attention(q, k, v, causal=True, cu_seqlens_q=torch.tensor(bad, dtype=torch.int32))
    assert not [c for c in fake if c[0] == "thd"]


def test_packed_non_causal_window_runs_on_flash_attn_and_falls_back_without_it(monkeypatch, caplog):
    """TE's fused backend takes windows (left, 0) with causal mask types only and its unfused one no thd:
    a non-causal window on thd needs flash-attn. Without it TE raises its ValueError before computing
    anything, and the adapter runs SDPA for that call (logged); with it, TE runs the call."""
    q, k, v, cu, _ = _packed([1, 6, 9], [1, 6, 9])
    kw = dict(causal=False, cu_seqlens_q=cu, window=(2, 1), softmax_scale=0.3)
    calls = _install(monkeypatch, flash_attn=False)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        got = adapter.attention(q, k, v, **kw)
    torch.testing.assert_close(got, _exact(q, k, v, **kw), **_SDPA_TOL)
    assert [c for c in calls if c[0] != "init"] == []
    assert "TE has no attention backend for this call (thd, non-causal, window (2, 1)" in caplog.text
    assert "No dot product attention backend is available" in caplog.text
    calls = _install(monkeypatch, flash_attn=True)
    torch.testing.assert_close(adapter.attention(q, k, v, **kw), _exact(q, k, v, **kw), **_HALF_TOL)
    assert calls[-1] == ("thd", "padding", (2, 1))
    adapter._modules.clear()
    DEFAULT_REGISTRY.clear_cache()


def test_packed_queries_behind_a_longer_key_sequence_are_bottom_right_aligned(fake):
    """Prompt-sharing style: each sequence's queries are its last tokens, keys cover the whole sequence."""
    q, k, v, cu_q, cu_k = _packed([2, 3], [5, 7], seed=1)
    got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(got, _exact(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), **_HALF_TOL)
    assert fake[0] == ("init", 4, 2, "thd", "cross")


def test_strided_inputs_reach_te_with_a_unit_last_stride(fake):
    """TE asserts 'q, k and v must have stride 1 in their last dimension!' and its kernels read cu_seqlens
    by pointer: a q with another last-dim stride and a strided cu_seqlens view are copied first."""
    q, k, v, cu, _ = _packed([3, 5], [3, 5], seed=3)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) == 4
    cu_view = torch.stack([cu, cu], 1).reshape(-1)[::2]  # stride 2
    assert qt.stride(-1) != 1 and not cu_view.is_contiguous()
    got = adapter.attention(qt, k, v, causal=True, cu_seqlens_q=cu_view)
    torch.testing.assert_close(got, _exact(q, k, v, causal=True, cu_seqlens_q=cu), **_HALF_TOL)
    qb = qt[None]
    got = adapter.attention(qb, k[None], v[None], causal=True)
    torch.testing.assert_close(got, _exact(q[None], k[None], v[None], causal=True), **_HALF_TOL)
    assert [c[0] for c in fake if c[0] != "init"] == ["thd", "bshd"]


def test_batched_bshd_decoding_shape_matches_the_reference(fake):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64).bfloat16()
    k, v = (torch.randn(2, 7, 1, 8, generator=g, dtype=torch.float64).bfloat16() for _ in range(2))
    for causal in (True, False):
        got = adapter.attention(q, k, v, causal=causal)
        torch.testing.assert_close(got, _exact(q, k, v, causal=causal), rtol=1e-2, atol=1e-2)  # one bf16 rounding
    assert [c[:2] for c in fake if c[0] == "bshd"] == [("bshd", "causal_bottom_right"), ("bshd", "no_mask")]
    assert fake[0] == ("init", 4, 1, "bshd", "cross")


def test_attention_fallbacks_run_sdpa_and_say_why(fake, caplog):
    q, k, v, cu, _ = _packed([3, 5], [3, 5], d=12)
    q8, k8, v8, cu8, _ = _packed([3, 5], [3, 5])
    q32, k32, v32, cu32, _ = _packed([3, 5], [3, 5], dtype=torch.float32)
    qb, kb, vb = q8[None], k8[None], v8[None]
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, :2] = False
    qx, kx, vx, cu_q, cu_k = _packed([4, 2], [3, 2])
    qw, kw_, vw, cu_wq, cu_wk = _packed([3, 2], [4, 2])
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        cases = [
            (dict(q=q, k=k, v=v, causal=True, cu_seqlens_q=cu)),
            (dict(q=q32, k=k32, v=v32, causal=True, cu_seqlens_q=cu32)),
            (dict(q=qb, k=kb, v=vb, causal=False, key_padding_mask=mask)),
            (dict(q=q8, k=k8, v=v8, causal=False, cu_seqlens_q=cu8, window=(2, -1))),
            (dict(q=qx, k=kx, v=vx, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)),
            (dict(q=qw, k=kw_, v=vw, causal=False, cu_seqlens_q=cu_wq, cu_seqlens_k=cu_wk, window=(1, 1))),
            (dict(q=qb, k=kb[:, :5], v=vb[:, :5], causal=True)),
        ]
        for kw in cases:
            args = (kw.pop("q"), kw.pop("k"), kw.pop("v"))
            torch.testing.assert_close(adapter.attention(*args, **kw), _exact(*args, **kw), **_SDPA_TOL)
    assert fake == []
    for reason in ("dtype torch.float32", "head dim 12", "key_padding_mask", "window (2, -1)", "longer than its key sequence",
                   "non-causal window with query and key lengths that differ"):
        assert reason in caplog.text, reason
    assert "falls back to torch SDPA" in caplog.text


def test_other_errors_of_te_are_not_swallowed(fake, monkeypatch):
    """Only TE's 'no backend' ValueError means 'run SDPA': any other error reaches the caller."""
    q, k, v, cu, _ = _packed([3, 5], [3, 5])

    def broken(*args, **kwargs):
        raise ValueError("something else")

    monkeypatch.setattr(sys.modules["transformer_engine.pytorch"].DotProductAttention, "__call__", broken)
    with pytest.raises(ValueError, match="something else"):
        adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu)


def test_auto_takes_it_on_cuda_for_its_dtypes_only(fake):
    for op in ("rms_norm", "layer_norm", "attention"):
        assert DEFAULT_REGISTRY.choose(op, "cuda", torch.bfloat16) == "transformer_engine"
        assert DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) != "transformer_engine"
    assert DEFAULT_REGISTRY.choose("rms_norm", "cuda", torch.float32) == "transformer_engine"
    why = DEFAULT_REGISTRY._probe("attention", DEFAULT_REGISTRY.backends["attention"]["transformer_engine"], "cuda", torch.float32)
    assert why and "float32" in why


def test_forced_without_the_package_names_the_reason():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    DEFAULT_REGISTRY.clear_cache()
    x = torch.randn(2, 8)
    with K.use_backends({"rms_norm": "transformer_engine"}), \
            pytest.raises(K.BackendUnavailableError, match=r"'rms_norm'.*'transformer_engine'.*transformer_engine is not installed"):
        K.rms_norm(x, torch.ones(8), 1e-6)


def test_a_job_with_a_forced_backend_that_cannot_run_exits_2(tmp_path, monkeypatch, capsys):
    """`[kernels] rms_norm = "transformer_engine"` on a machine without it: the job stops with exit 2 and the
    registry's reason on stderr (the runner's config-error path), not a traceback."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    repo = __import__("pathlib").Path(__file__).resolve().parents[3]
    cfg = load_config(repo / "launch" / "configs" / "demo_sft.toml",
                      [f'train.output_dir="{tmp_path}"', 'kernels.rms_norm="transformer_engine"'])

    def run_kind(ctx, before_step=None):  # what the job's first forward does: configure, then call the op
        previous = K.configure(ctx.cfg.kernels)
        try:
            K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
        finally:
            DEFAULT_REGISTRY.restore(previous)
        return 0

    monkeypatch.setattr(runner, "run_kind", run_kind)
    monkeypatch.setattr(runner, "_prepare_model_folder", lambda cfg, env: None)
    DEFAULT_REGISTRY.clear_cache()
    assert runner.run_job(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: kernels: op 'rms_norm' is configured to backend 'transformer_engine'"), err
    assert "transformer_engine is not installed" in err
