"""`rms_norm`, `layer_norm` and `attention` on NVIDIA Transformer Engine (`transformer_engine.pytorch`),
chosen by `auto` on CUDA when the package is installed (experimental: not yet run on a GPU).

Norms: TE's RMSNorm / LayerNorm modules own their weight, while our ops take the caller's weight, so the
adapter calls the kernels those modules run in their forward / backward (the `transformer_engine_torch`
bindings `rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)` ->
(y, _, rsigma), `rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)` -> (dx, dgamma) and
the `layernorm_*` pair with a bias and the means) inside an autograd function of its own, so the
gradients reach the caller's weight and bias. Documented constraints, and what the adapter does:

- that binding signature is TE's from 2.1 on -> an older TE runs the reference (logged once);
- dtypes fp32 / fp16 / bf16 (the registry's check); the weight must have the input's dtype (the backward
  checks `dz.dtype == gamma.dtype`) -> a weight of another dtype is cast (its gradient flows back through
  the cast), rows are made contiguous `[N, H]`;
- hidden sizes that are a multiple of 8 (16-byte rows in bf16, the vectorised loads TE's kernels are
  built for) -> other sizes run the reference (logged once);
- the fused residual add of our `rms_norm` has no forward counterpart in TE: the sum is rounded to x's
  dtype (as the reference does) and normalised by TE; LayerNorm without weight gets a weight of ones.

Attention: `DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups, attention_dropout=0,
qkv_format, softmax_scale)` (one module per heads / head dim / scale / layout, cached: the scale is a
constructor argument; `attention_type="cross"` where query and key lengths may differ), called with packed `[T, H, D]` as `qkv_format="thd"` + `cu_seqlens_q` /
`cu_seqlens_kv` / `max_seqlen_q` / `max_seqlen_kv`, batched `[B, S, H, D]` as `"bshd"`; causal is
`"padding_causal_bottom_right"` / `"causal_bottom_right"` (our bottom-right alignment), non-causal
`"padding"` / `"no_mask"`; `window_size=(left, right)` with -1 unbounded; GQA by `num_gqa_groups`. TE's
output `[T, H * D]` is viewed back to q's shape. Documented constraints, and what the adapter does:

- fp16 / bf16 only (the registry's check);
- head dims that are a multiple of 8 and at most 256 (what its fused and flash backends accept) -> other
  head dims run torch SDPA (our `sdpa` backend, same contract; logged once);
- windows must be (-1, -1) or (>= 0, >= 0) without causal -> a window bounded on one side only runs SDPA;
- a batched call with `key_padding_mask` runs SDPA (TE would need its own padding-mask convention);
- a query that sees no key outputs zeros in our contract; TE's behaviour there is not documented -> calls
  whose query sequences are longer than their key sequences run SDPA (packed: checked once per call, one
  device sync, only when `cu_seqlens_k` differs from `cu_seqlens_q`);
- TE aligns windows with the causal mask's corner (bottom-right for the "bottom_right" types); for
  non-causal windows the corner depends on the TE version -> a non-causal window with query and key
  lengths that differ runs SDPA.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

from ..reference import norms as reference_norms
from ..reference.attention import check_attention_inputs, normalize_window

logger = logging.getLogger("megatron_vlm.kernels")
logger.info("kernels: Transformer Engine backend loaded (experimental: not yet run on a GPU)")  # imported when first chosen
_logged: set = set()
_MIN_VERSION = (2, 1)
_MAX_HEAD_DIM = 256
_modules: Dict[tuple, object] = {}


def _log_fallback(op: str, reason: str, to: str = "the torch reference") -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.info("%s: backend transformer_engine falls back to %s: %s", op, to, reason)


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _norm_binding_reason() -> Optional[str]:
    """None when TE's norm bindings have the 2.1+ signature, else why not."""
    import transformer_engine

    version = getattr(transformer_engine, "__version__", "0")
    if _version_tuple(version) < _MIN_VERSION:
        return f"transformer_engine {version} (the fused norm bindings used here are TE's from 2.1 on)"
    return None


def _norm_reason(x: torch.Tensor) -> Optional[str]:
    if x.shape[-1] % 8:
        return f"hidden size {x.shape[-1]} (TE's norm kernels are used for multiples of 8 only)"
    return _norm_binding_reason()


def _otype(dtype: torch.dtype):
    from transformer_engine.pytorch.constants import TE_DType

    return TE_DType[dtype]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        import transformer_engine_torch as tex

        y, _, rsigma = tex.rmsnorm_fwd(x2d, weight, eps, None, None, _otype(x2d.dtype), 0, False)
        ctx.save_for_backward(x2d, rsigma, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        import transformer_engine_torch as tex

        x2d, rsigma, weight = ctx.saved_tensors
        dx, dw = tex.rmsnorm_bwd(dy.contiguous(), x2d, rsigma, weight, 0, False)[:2]
        return dx, dw, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        import transformer_engine_torch as tex

        y, mu, rsigma = tex.layernorm_fwd(x2d, weight, bias, eps, None, None, _otype(x2d.dtype), 0, False)
        ctx.save_for_backward(x2d, mu, rsigma, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        import transformer_engine_torch as tex

        x2d, mu, rsigma, weight = ctx.saved_tensors
        dx, dw, db = tex.layernorm_bwd(dy.contiguous(), x2d, mu, rsigma, weight, 0, False)[:3]
        return dx, dw, db if ctx.has_bias else None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None):
    """Public-signature RMSNorm on TE's fused kernels (contract: kernels/reference/norms.py)."""
    reason = _norm_reason(x)
    if reason is not None:
        _log_fallback("rms_norm", reason)
        return reference_norms.rms_norm(x, weight, eps, residual=residual)
    reference_norms._check_weight("rms_norm", x, weight, "weight")
    summed = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        summed = x + residual  # rounded to x's dtype, as the reference's fused path
        x = summed
    out = _RMSNorm.apply(_rows(x), weight.to(x.dtype), float(eps)).view(x.shape)
    return out if summed is None else (out, summed)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Public-signature LayerNorm on TE's fused kernels (contract: kernels/reference/norms.py)."""
    reason = _norm_reason(x)
    if reason is not None:
        _log_fallback("layer_norm", reason)
        return reference_norms.layer_norm(x, weight, bias, eps)
    reference_norms._check_weight("layer_norm", x, weight, "weight")
    reference_norms._check_weight("layer_norm", x, bias, "bias")
    w = x.new_ones(x.shape[-1]) if weight is None else weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    return _LayerNorm.apply(_rows(x), w, b, float(eps)).view(x.shape)


def _module(heads: int, kv_heads: int, head_dim: int, scale: float, qkv_format: str, cross: bool, device: torch.device):
    key = (heads, kv_heads, head_dim, scale, qkv_format, cross, str(device))
    if key not in _modules:
        from transformer_engine.pytorch import DotProductAttention

        _modules[key] = DotProductAttention(
            heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0, qkv_format=qkv_format,
            attention_type="cross" if cross else "self", softmax_scale=scale,
        )
    return _modules[key]


def _attention_reason(q, k, causal, left, right, cu_seqlens_q, cu_seqlens_k, key_padding_mask) -> Optional[str]:
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return f"head dim {head_dim} (TE's attention backends take multiples of 8 up to {_MAX_HEAD_DIM})"
    if key_padding_mask is not None:
        return "key_padding_mask on the batched layout"
    if not causal and (left < 0) != (right < 0):
        return f"window ({left}, {right}) bounded on one side only (TE takes (-1, -1) or (>= 0, >= 0))"
    windowed = not causal and (left >= 0 or right >= 0)
    if q.dim() == 4:
        if q.shape[1] > k.shape[1]:
            return "a query sequence longer than its key sequence (queries without keys)"
        if windowed and q.shape[1] != k.shape[1]:
            return "a non-causal window with query and key lengths that differ (alignment not documented)"
    elif cu_seqlens_k is not cu_seqlens_q:
        lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        if bool((lq > lk).any()):
            return "a query sequence longer than its key sequence (queries without keys)"
        if windowed and not torch.equal(lq, lk):
            return "a non-causal window with query and key lengths that differ (alignment not documented)"
    return None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    window: Optional[Tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Public-signature attention on TE's DotProductAttention (contract: kernels/reference/attention.py)."""
    cu_q, cu_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, key_padding_mask)
    left, right = normalize_window(window, causal)
    reason = _attention_reason(q, k, causal, left, right, cu_q, cu_k, key_padding_mask)
    if reason is not None:
        _log_fallback("attention", reason, to="torch SDPA (the sdpa backend)")
        from ..sdpa.attention import attention as sdpa_attention

        return sdpa_attention(
            q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    window_size = (left, right)
    if q.dim() == 4:
        module = _module(q.shape[2], k.shape[2], q.shape[3], scale, "bshd", q.shape[1] != k.shape[1], q.device)
        out = module(q, k, v, qkv_format="bshd", attn_mask_type="causal_bottom_right" if causal else "no_mask",
                     window_size=window_size)
        return out.reshape(q.shape)
    if max_seqlen_q is None:
        max_seqlen_q = int(cu_q.diff().max().item())
    if max_seqlen_k is None:
        max_seqlen_k = max_seqlen_q if cu_k is cu_q else int(cu_k.diff().max().item())
    module = _module(q.shape[1], k.shape[1], q.shape[2], scale, "thd", cu_k is not cu_q, q.device)
    out = module(
        q, k, v, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_kv=int(max_seqlen_k), attn_mask_type="padding_causal_bottom_right" if causal else "padding",
        window_size=window_size,
    )
    return out.reshape(q.shape)
