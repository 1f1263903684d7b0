"""Packed `attention` on torch's own flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA).

Why: the fair baseline for our packed varlen Triton kernel is a flash varlen kernel, and recent torch builds
ship one (FlashAttention-2/3 under `varlen_attn`, torch >= 2.10) without the flash-attn package. This
backend runs it for the training layout (packed `[T, H, D]` + one `cu_seqlens` for queries and keys,
fp16 / bf16, head dim <= 256) and hands every other call to our Triton kernel where it runs, else to torch SDPA
(logged once per reason): batched or padded layouts, queries and keys of different lengths (the prompt-shared packs
of GRPO and DPO), windows the release cannot take, fp32, other devices. `auto` takes it on CUDA (below flash-attn and
Transformer Engine when installed): on an H200 it beat our Triton varlen kernel alone and in the SFT step
(benchmarks/RESULTS.md, "Fifth GPU run").

Its Python signature changed across releases: `is_causal=` (2.10 / 2.11) became `window_size=(left, right)`
(causal = right side 0), and `scale=` / `enable_gqa=` were added; the adapter reads the signature once and
maps our arguments onto what the installed release takes. GQA without `enable_gqa` repeats k / v heads
(a copy, counted in the time); a window or a non-default scale that the release cannot take falls back.
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch

from ..reference.attention import check_attention_inputs, normalize_window, packed_max_seqlens
from ..registry import assume_constant_result

logger = logging.getLogger(__name__)
_logged: set = set()
_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


_found: dict = {}  # a plain dict, not functools.cache: compiled blocks trace this lookup without a cache wrapper


def _varlen():
    """(varlen_attn, its parameter names) or (None, reason); looked up once."""
    if "varlen" not in _found:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            _found["varlen"] = None, f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
        else:
            _found["varlen"] = varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
    return _found["varlen"]


def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Why the backend cannot run here (registry check), or None."""
    if device_type != "cuda":
        return "torch's varlen_attn runs on CUDA only"
    if dtype not in _DTYPES:
        return f"dtype {dtype} (varlen_attn takes float16 / bfloat16)"
    fn, info = _varlen()
    return info if fn is None else None


@assume_constant_result
def _fallback_to_triton(reason: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether a call this backend does not map runs our Triton kernel (else SDPA); logged once per reason. Run
    eagerly while dynamo traces a compiled block (a constant of its graph): the availability probe and the log call
    inside the trace would each break the graph, in every layer of a prompt-shared pack."""
    from ..availability import triton_check

    triton_ok = triton_check(device_type, dtype) is None
    if reason not in _logged:
        _logged.add(reason)
        logger.info("attention: backend torch_varlen falls back to %s: %s",
                    "our Triton kernel" if triton_ok else "torch SDPA (the sdpa backend)", reason)
    return triton_ok


def _fallback(reason: str, q, k, v, **kwargs) -> torch.Tensor:
    """Our Triton kernel where it runs (CUDA: the backend `auto` took before this one), else torch SDPA."""
    if _fallback_to_triton(reason, q.device.type, q.dtype):
        from ..triton.attention import attention as triton_attention

        return triton_attention(q, k, v, **kwargs)
    from ..sdpa.attention import attention as sdpa_attention

    return sdpa_attention(q, k, v, **kwargs)


def _call_kwargs(params: frozenset, causal: bool, left: int, right: int, scale: Optional[float], default_scale: float,
                 gqa: bool) -> tuple[Optional[dict], Optional[str]]:
    """varlen_attn keyword arguments for our call, or (None, why the release cannot take it)."""
    kw: dict = {}
    if "window_size" in params:
        kw["window_size"] = (left, 0 if causal else right)
    elif left >= 0 or (right >= 0 and not causal):
        return None, "a window (this torch's varlen_attn takes none)"
    elif "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        return None, "causal attention (this torch's varlen_attn has neither window_size nor is_causal)"
    if scale is not None and scale != default_scale:
        if "scale" not in params:
            return None, "a softmax scale other than D ** -0.5 (this torch's varlen_attn takes none)"
        kw["scale"] = scale
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw, None


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
    """Public-signature attention on torch's varlen_attn (contract: kernels/reference/attention.py)."""
    args = dict(causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask)
    fn, params = _varlen()
    if fn is None:
        return _fallback(params, q, k, v, **args)
    if q.dim() != 3 or key_padding_mask is not None:
        return _fallback("batched or padded layout (varlen_attn takes packed sequences)", q, k, v, **args)
    cu_q, cu_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, None)
    if cu_k is not cu_q:  # no host read of both to compare them: self-attention passes one tensor twice
        return _fallback("separate query and key cu_seqlens (only self-attention packs are mapped)", q, k, v, **args)
    reason = check(q.device.type, q.dtype)
    if reason is None and q.shape[-1] > _MAX_HEAD_DIM:
        reason = f"head dim {q.shape[-1]} (flash kernels take up to {_MAX_HEAD_DIM})"
    if reason is None and q.numel() == 0:
        reason = "no query element"
    if reason is not None:
        return _fallback(reason, q, k, v, **args)
    left, right = normalize_window(window, causal)
    # a hint given: trusted (no host sync per layer); else one sync that also checks cu_seqlens (the kernel does not)
    max_len = packed_max_seqlens(cu_q, cu_q, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_q, check_hints=False)[0]
    from ..thirdparty.flash_attn import _window_reason  # the same flash kernels rewrite windows the same way

    reason = _window_reason(causal, left, right, max_len, max_len)
    if reason is not None:
        return _fallback(reason, q, k, v, **args)
    gqa = q.shape[1] != k.shape[1]
    kw, reason = _call_kwargs(params, causal, left, right, softmax_scale, q.shape[-1] ** -0.5, gqa)
    if reason is not None:
        return _fallback(reason, q, k, v, **args)
    if gqa and "enable_gqa" not in kw:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu_q.to(q.device, torch.int32).contiguous()
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)
