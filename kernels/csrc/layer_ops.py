"""rms_norm, swiglu and decode_attention on the fused CPU kernels of `megatron_vlm._C` (csrc/cpu_layer_ops.cpp,
csrc/cpu_decode_attention.cpp).

Why: on a CPU the torch references run each op as a chain of elementwise ATen calls, each allocating
and streaming a full-size temporary; at the GRPO / SFT shapes of a small model those chains and the
flash-SDPA call per decoding step cost about as much as the GEMMs around them. The C++ kernels read
inputs once and write outputs once (forward and backward), and decode attention runs one task per
sequence (or per (sequence, kv head) when there are fewer sequences than threads) over exactly that
sequence's cached keys, walked in address order in L1-sized blocks that every query head of a GQA group
reads before the next.

Contract: the same signatures, layouts and errors as the references (`kernels/reference/norms.py`,
`swiglu.py`, `decode_attention.py`); results equal them to fp32 rounding (different summation order,
a polynomial exp: tests/unit/kernels/test_csrc_layer_ops.py). The kernels take contiguous float32 CPU
tensors; anything else (another dtype, a DTensor, a mixed-dtype cache) runs the reference, so a call
never fails for a layout the reference accepts. The registry sends only CPU float32 calls here (`check`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..reference.decode_attention import check_decode_attention_inputs
from ..reference.decode_attention import decode_attention as _ref_decode_attention
from ..reference.norms import rms_norm as _ref_rms_norm
from ..reference.rotary import apply_rotary as _ref_apply_rotary
from ..reference.rotary import expand_cos_sin
from ..reference.swiglu import swiglu as _ref_swiglu

__all__ = ["check", "rms_norm", "swiglu", "apply_rotary", "decode_attention"]


def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Kernels-registry check: None for CPU float32 with the extension loaded, else why not."""
    from megatron_vlm._ext import backend_check

    reason = backend_check(device_type, dtype)
    if reason is not None:
        return reason
    if device_type != "cpu":
        return f"tensor on {device_type}; the csrc layer ops run on the CPU"
    if dtype != torch.float32:
        return (f"{dtype}; the csrc layer ops take float32 only (set the op to auto to run other dtypes on "
                "the torch reference)")
    return None


_LOADED = False


def _ops():
    """torch.ops.megatron_vlm once the extension is loaded (the registry's check loads it first in normal use);
    the load is checked once, not on every call of these per-token ops."""
    global _LOADED
    if not _LOADED:
        from megatron_vlm._ext import load

        if load() is None:
            raise RuntimeError("megatron_vlm._C is not available; the csrc backend cannot run")
        _LOADED = True
    return torch.ops.megatron_vlm


def _fits(*tensors) -> bool:
    """Plain (not a DTensor or other subclass) float32 CPU tensors: what the C++ kernels take."""
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


def _on_cpu(*tensors) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _RMSNorm(torch.autograd.Function):
    """(out, summed): summed = x + residual (an empty tensor without residual, not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        out, summed, rstd = _ops().rms_norm_fwd(x, weight, residual, eps)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(summed if ctx.has_residual else x, weight, rstd)
        ctx.set_materialize_grads(False)
        if not ctx.has_residual:
            ctx.mark_non_differentiable(summed)
        return out, summed

    @staticmethod
    def backward(ctx, g_out, g_summed):
        normed, weight, rstd = ctx.saved_tensors
        if g_out is None:
            g_out = torch.zeros_like(normed)
        if not ctx.has_residual:
            g_summed = None  # non-differentiable; a compiled backward still hands it a zero grad of its [0] shape
        elif g_summed is not None:
            g_summed = g_summed.contiguous()
        g_in, g_w = _ops().rms_norm_bwd(g_out.contiguous(), g_summed, normed, weight, rstd)
        return g_in, g_w if ctx.needs_input_grad[1] else None, g_in if ctx.has_residual else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None):
    """kernels.rms_norm: y = x / sqrt(mean(x^2) + eps) * weight; with residual (rms_norm(x + residual), x + residual)."""
    if not _fits(x, weight, residual) or weight.shape != (x.shape[-1],) or (
            residual is not None and residual.shape != x.shape) or x.shape[-1] == 0:
        return _ref_rms_norm(x, weight, eps, residual=residual)
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    if _needs_grad(x, weight, residual):
        out, summed = _RMSNorm.apply(x, weight, residual, float(eps))
    else:
        out, summed, _ = _ops().rms_norm_fwd(x, weight, residual, float(eps))
    return out if residual is None else (out, summed)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _ops().swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = _ops().swiglu_bwd(grad.contiguous(), gate, up)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """kernels.swiglu: silu(gate) * up (gate and up of the same shape)."""
    if not _fits(gate, up) or gate.shape != up.shape:
        return _ref_swiglu(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    if _needs_grad(gate, up):
        return _SwiGLU.apply(gate, up)
    return _ops().swiglu_fwd(gate, up)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _ops().rotary(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _ops().rotary(grad.contiguous(), cos, sin, True), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                 rotary_dim: Optional[int] = None) -> torch.Tensor:
    """kernels.apply_rotary, rotate-half convention over the whole head dim (Qwen / Llama / InternVL LMs);
    interleaved pairs and partial rotary run the reference. cos / sin: constants (no gradient)."""
    head_dim, lead = x.shape[-1], x.shape[:-2]
    if (not interleaved and rotary_dim in (None, head_dim) and cos.shape == sin.shape and cos.shape[:-1] == lead
            and cos.shape[-1] == head_dim and x.dim() >= 3 and cos.is_contiguous() and sin.is_contiguous()
            and _fits(x, cos, sin) and not _needs_grad(cos, sin) and head_dim % 2 == 0):
        c, s = cos, sin  # per token already: [..., T, D] for x [..., T, H, D] (the decoder's layout)
    else:
        full, fsin = expand_cos_sin(x, cos, sin, interleaved, rotary_dim)  # the reference's checks and errors
        if interleaved or full.shape[-1] != head_dim or not _fits(x, cos, sin) or _needs_grad(cos, sin):
            return _ref_apply_rotary(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
        c = full.squeeze(-2).expand(*lead, head_dim).contiguous()
        s = fsin.squeeze(-2).expand(*lead, head_dim).contiguous()
    x3 = x.contiguous().view(math.prod(lead), x.shape[-2], head_dim)
    out = _Rotary.apply(x3, c, s) if _needs_grad(x) else _ops().rotary(x3, c, s, False)
    return out.view(x.shape)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    slot_ids: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    shared_prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """kernels.decode_attention (slot or paged cache), one C++ task per sequence (module docstring); no autograd
    (decoding runs without gradients: a call that needs them runs the reference). With `shared_prefix`, each
    group of sequences that share their first keys reads them once (`decode_attention_prefix` of
    csrc/cpu_decode_attention.cpp: all the group's query heads against one copy, then each sequence's own keys,
    the two softmaxes merged)."""
    check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, shared_prefix)
    if (not _fits(q, k_cache, v_cache) or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or _needs_grad(q, k_cache, v_cache) or not _on_cpu(cache_seqlens, slot_ids, block_table)):
        return _ref_decode_attention(q, k_cache, v_cache, cache_seqlens, slot_ids=slot_ids, block_table=block_table,
                                     max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale)
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    length = capacity if max_seqlen_k is None else min(int(max_seqlen_k), capacity)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if (shared_prefix is not None and _on_cpu(*shared_prefix)
            and hasattr(_ops(), "decode_attention_prefix")):  # a _C built before the op: each own copy
        return _ops().decode_attention_prefix(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, length,
                                              scale, shared_prefix[0], shared_prefix[1])
    return _ops().decode_attention(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, length, scale)
