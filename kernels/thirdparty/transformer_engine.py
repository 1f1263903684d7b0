"""`rms_norm`, `layer_norm` and `attention` on NVIDIA Transformer Engine (`transformer_engine.pytorch`),
chosen by `auto` on CUDA when the package is installed (experimental: not yet run on a GPU).

Norms: TE's RMSNorm / LayerNorm modules own their weight, while our ops take the caller's weight, so the
adapter calls the kernels those modules run in their forward / backward (the `transformer_engine_torch`
bindings `rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)` ->
(y, None, rsigma fp32 [N]), `rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)` ->
(dx, dgamma), `layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin,
zero_centered_gamma)` -> (y, mu fp32, rsigma fp32), `layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin,
zero_centered_gamma)` -> (dx, dgamma, dbeta); ln_out / quantizer None, otype x's dtype, sm_margin 0, as
TE's `ops/basic/rmsnorm.py` / `layer_norm.py` call them) inside an autograd function of its own, so the
gradients reach the caller's weight and bias. What TE checks (read in TE 2.9 and compared with 2.0-2.18:
`pytorch/csrc/extensions/normalization.cpp`, `common/normalization/{rmsnorm/rmsnorm_api.cpp,
layernorm/ln_api.cpp, common.{h,cpp}}`, `common/transformer_engine.cpp`), and what the adapter does:

- the binding signature above (TE's since 2.0; the adapter takes 2.1 on) -> an older TE runs the reference
  (logged once);
- dtypes: `TE_DType` knows fp32 / fp16 / bf16 only, and the kernels exist for weight, input and output of
  one dtype (plus fp32 weight and input with a 16-bit output; "Unavailable kernel for this normalization
  config" otherwise); the backward needs `dz.dtype == gamma.dtype` -> other dtypes run the reference
  (logged once; the registry sends only those three), a weight / bias of another dtype is cast to x's
  (its gradient flows back through the cast; the weight is then rounded to x's dtype, where the reference
  multiplies by it in fp32);
- x 2-D, the weight `[H]` (`Gamma must have the same hidden size`), the output allocated by TE; the forward
  reads x and the weight through their data pointers without making them contiguous -> rows are made
  contiguous `[N, H]` and the weight / bias contiguous (the backward makes its inputs contiguous itself);
- LayerNorm: `Gamma and Beta must have the same shape` / dtype, so a missing bias (an empty tensor there)
  is refused -> LayerNorm without bias gets a bias of zeros (its gradient dropped), without weight a
  weight of ones;
- `Epsilon must be non-negative` -> a negative eps runs the reference (logged once);
- inputs must be allocated (`Input x is not allocated!`: an empty tensor has no data pointer) -> empty
  inputs run the reference (logged once);
- no rule on the hidden size: the kernels load a row's tail / unaligned rows element by element -> still,
  the adapter keeps TE to hidden sizes that are a multiple of 8 (16-byte rows in bf16) and runs the
  reference for others (logged once);
- rsigma / mu come back fp32 and are saved for the backward as they are.
The fused residual add of our `rms_norm` has no forward counterpart in TE: the sum is rounded to x's dtype
(as the reference does) and normalised by TE.

Attention: `DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups, attention_dropout=0,
qkv_format, attention_type, softmax_scale)` (one module per heads / head dim / scale / layout / self-cross,
cached: the scale is a constructor argument; `attention_type="cross"` where query and key lengths may
differ), called with packed `[T, H, D]` as `qkv_format="thd"` + `cu_seqlens_q` / `cu_seqlens_kv` (int32,
same shape) / `max_seqlen_q` / `max_seqlen_kv`, batched `[B, S, H, D]` as `"bshd"`; causal is
`"padding_causal_bottom_right"` / `"causal_bottom_right"` (our bottom-right alignment), non-causal
`"padding"` / `"no_mask"` (thd needs a "padding" type); `window_size=(left, right)` with -1 unbounded,
which TE's `check_set_window_size` takes as (-1, 0) / (>= 0, 0) for causal types and (-1, -1) /
(>= 0, >= 0) for the others (its docstring: query i sees keys [i + Sk - Sq - left, i + Sk - Sq + right],
bottom-right); GQA by `num_gqa_groups` (heads divisible by it). TE's output `[T, H * D]` / `[B, S, H * D]`
is reshaped to q's shape. What TE checks (`pytorch/attention/dot_product_attention/dot_product_attention.py`
`DotProductAttention.forward`, `utils.py` `check_set_window_size`, `get_qkv_layout`,
`get_attention_backend`, `common/fused_attn/fused_attn.cpp` `nvte_get_fused_attn_backend`), and what the
adapter does:

- q, k, v CUDA (the registry picks this backend on CUDA only), of one dtype (our contract's check), k / v
  heads = `num_gqa_groups`, head dims = `kv_channels` -> as the module is built;
- fp16 / bf16: its flash and fused backends take nothing else and its unfused one takes no thd -> other
  dtypes run torch SDPA (our `sdpa` backend, same contract; logged once; the registry sends only those);
- `q, k and v must have stride 1 in their last dimension!` (an assertion, not a fix-up) -> a tensor with
  another last-dim stride is made contiguous;
- cu_seqlens int32 (our contract's too), 1-D, same shape -> as given, moved to q's device and made
  contiguous (no copy when they already are);
- head dims: its backends take multiples of 8 up to 256 (fused: up to 128, or 256 on Hopper with recent
  cuDNN; unfused, bshd only: any) -> other head dims run SDPA (logged once);
- windows must be (-1, -1) or (>= 0, >= 0) without causal -> a window bounded on one side only runs SDPA;
  causal windows are sent as (left, 0);
- which backend runs is decided at run time from the GPU, cuDNN, flash-attn and the call (e.g. thd needs
  flash-attn or the fused backend on sm90+; a non-causal window on thd needs flash-attn, the fused backend
  taking windows (left, 0) with causal masks only); where none fits, TE raises `ValueError("No dot product
  attention backend is available ...")` before computing anything -> that call runs SDPA (logged once);
- a batched call with `key_padding_mask` runs SDPA (TE would need its own padding-mask convention);
- a query that sees no key outputs zeros in our contract; TE's behaviour there is not documented and its
  fused bottom-right masks need Sq <= Sk -> calls whose query sequences are longer than their key
  sequences run SDPA (packed: checked once per call, one device sync, only when `cu_seqlens_k` differs
  from `cu_seqlens_q`);
- non-causal windows are bottom-right aligned by TE's docstring and its flash / unfused backends, but TE
  < 2.12 documents its fused backend's windows as top-left -> a non-causal window with query and key
  lengths that differ runs SDPA (causal windows go to the "bottom_right" mask types, whose alignment is
  bottom-right in every backend).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..reference import norms as reference_norms
from ..reference.attention import check_attention_inputs, normalize_window, packed_max_seqlens

logger = logging.getLogger("megatron_vlm.kernels")
logger.info("kernels: Transformer Engine backend loaded (experimental: not yet run on a GPU)")  # imported when first chosen
_logged: set = set()
_MIN_VERSION = (2, 1)
_MAX_HEAD_DIM = 256
_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the keys of TE's TE_DType that its norm kernels take
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
_NO_BACKEND = "No dot product attention"  # how DotProductAttention.forward's ValueError starts (2.1: "... support", later "... backend")
_modules: dict[tuple, object] = {}


def _log_fallback(op: str, reason: str, to: str = "the torch reference") -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.info("%s: backend transformer_engine falls back to %s: %s", op, to, reason)


def _version_tuple(text: str) -> tuple[int, ...]:
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


def _norm_reason(x: torch.Tensor, eps: float) -> Optional[str]:
    if x.dtype not in _NORM_DTYPES:
        return f"dtype {x.dtype} (TE's norm kernels take float32 / float16 / bfloat16)"
    if x.numel() == 0:
        return "an empty input (TE refuses tensors without data: 'Input x is not allocated!')"
    if eps < 0:
        return f"eps {eps} (TE checks 'Epsilon must be non-negative')"
    if x.shape[-1] % 8:
        return f"hidden size {x.shape[-1]} (the adapter uses TE's norm kernels for multiples of 8 only)"
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
        dx, dw = tex.rmsnorm_bwd(dy.to(weight.dtype).contiguous(), x2d, rsigma, weight, 0, False)[:2]
        return dx, dw, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        import transformer_engine_torch as tex

        has_bias = bias is not None
        if not has_bias:  # TE checks that gamma and beta have one shape: an absent beta is refused
            bias = torch.zeros_like(weight)
        y, mu, rsigma = tex.layernorm_fwd(x2d, weight, bias, eps, None, None, _otype(x2d.dtype), 0, False)
        ctx.save_for_backward(x2d, mu, rsigma, weight)
        ctx.has_bias = has_bias
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        import transformer_engine_torch as tex

        x2d, mu, rsigma, weight = ctx.saved_tensors
        dx, dw, db = tex.layernorm_bwd(dy.to(weight.dtype).contiguous(), x2d, mu, rsigma, weight, 0, False)[:3]
        return dx, dw, db if ctx.has_bias else None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1, x.shape[-1])


def _param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight / bias in x's dtype and contiguous: TE's forward reads it through its data pointer."""
    return p.to(dtype).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None):
    """Public-signature RMSNorm on TE's fused kernels (contract: kernels/reference/norms.py)."""
    reason = _norm_reason(x, eps)
    if reason is not None:
        _log_fallback("rms_norm", reason)
        return reference_norms.rms_norm(x, weight, eps, residual=residual)
    reference_norms._check_weight("rms_norm", x, weight, "weight")
    summed = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        # rounded to x's dtype, as the reference's fused path (one rounding; a residual of another dtype
        # would otherwise promote the sum)
        summed = x + residual if residual.dtype == x.dtype else (x.float() + residual.float()).to(x.dtype)
        x = summed
    out = _RMSNorm.apply(_rows(x), _param(weight, x.dtype), float(eps)).view(x.shape)
    return out if summed is None else (out, summed)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Public-signature LayerNorm on TE's fused kernels (contract: kernels/reference/norms.py)."""
    reason = _norm_reason(x, eps)
    if reason is not None:
        _log_fallback("layer_norm", reason)
        return reference_norms.layer_norm(x, weight, bias, eps)
    reference_norms._check_weight("layer_norm", x, weight, "weight")
    reference_norms._check_weight("layer_norm", x, bias, "bias")
    w = x.new_ones(x.shape[-1]) if weight is None else _param(weight, x.dtype)
    b = None if bias is None else _param(bias, x.dtype)
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
    if q.dtype not in _ATTENTION_DTYPES:
        return f"dtype {q.dtype} (TE's attention backends take float16 / bfloat16)"
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
            return "a non-causal window with query and key lengths that differ (alignment differs between TE's backends)"
    elif cu_seqlens_k is not cu_seqlens_q:
        lq, lk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        if bool((lq > lk).any()):
            return "a query sequence longer than its key sequence (queries without keys)"
        if windowed and not torch.equal(lq, lk):
            return "a non-causal window with query and key lengths that differ (alignment differs between TE's backends)"
    return None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """TE asserts 'q, k and v must have stride 1 in their last dimension!' (utils.get_qkv_layout)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(q, k, v, causal, cu_q, cu_k, max_seqlen_q, max_seqlen_k, window_size, scale):
    """TE's DotProductAttention on a call `_attention_reason` let through."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if q.dim() == 4:
        module = _module(q.shape[2], k.shape[2], q.shape[3], scale, "bshd", q.shape[1] != k.shape[1], q.device)
        out = module(q, k, v, qkv_format="bshd", attn_mask_type="causal_bottom_right" if causal else "no_mask",
                     window_size=window_size)
        return out.reshape(q.shape)
    # hints given: trusted (no host sync per layer); else one sync that also checks cu_seqlens (TE does not)
    max_seqlen_q, max_seqlen_k = packed_max_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                                                    check_hints=False)
    cross = cu_k is not cu_q
    cu_q = cu_q.to(q.device).contiguous()
    cu_k = cu_k.to(q.device).contiguous() if cross else cu_q
    module = _module(q.shape[1], k.shape[1], q.shape[2], scale, "thd", cross, q.device)
    out = module(
        q, k, v, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_kv=int(max_seqlen_k), attn_mask_type="padding_causal_bottom_right" if causal else "padding",
        window_size=window_size,
    )
    return out.reshape(q.shape)


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
    window: Optional[tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Public-signature attention on TE's DotProductAttention (contract: kernels/reference/attention.py)."""
    cu_q, cu_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, key_padding_mask)
    left, right = normalize_window(window, causal)
    reason = _attention_reason(q, k, causal, left, right, cu_q, cu_k, key_padding_mask)
    if reason is None:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        try:
            return _run(q, k, v, causal, cu_q, cu_k, max_seqlen_q, max_seqlen_k, (left, right), scale)
        except ValueError as err:  # raised by TE's backend selection, before any kernel runs
            if not str(err).startswith(_NO_BACKEND):
                raise
            reason = (f"TE has no attention backend for this call ({'thd' if q.dim() == 3 else 'bshd'}, "
                      f"{'causal' if causal else 'non-causal'}, window ({left}, {right}), {q.dtype}, "
                      f"head dim {q.shape[-1]}): {str(err).split('.')[0]}")
    _log_fallback("attention", reason, to="torch SDPA (the sdpa backend)")
    from ..sdpa.attention import attention as sdpa_attention

    return sdpa_attention(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
