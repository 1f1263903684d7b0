"""`attention` (packed varlen, causal or full) on the C++ CPU kernel of `megatron_vlm._C` (csrc/cpu_varlen_attention.cpp).

Why: a GRPO / SFT pack on the CPU is many short samples. The SDPA backend runs them as a padded batch with a
mask (gathers in, masked flash kernel over the padding, boolean gather out, and the same again backward); at the
GRPO shape of benchmarks/trl_grpo.py that was ~0.1 s of a ~0.7 s update. The C++ kernel computes each sample in
place, one task per (sample, kv head), and its backward recomputes the probabilities from the saved
log-sum-exp. It walks every query row over its visible keys without blocking, so it takes short samples only:
packed input with samples of at most `MAX_SEQLEN` keys, no sliding window, no padding mask, float32, head dim a
multiple of 8 (<= 512). Everything else runs the `sdpa` backend (kernels/sdpa/attention.py), same contract
(kernels/reference/attention.py); results equal it to fp32 rounding (tests/unit/csrc/test_csrc_attention.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference.attention import prepare_attention_args
from ..sdpa.attention import attention as _sdpa_attention
from .layer_ops import _fits, _needs_grad, _ops

__all__ = ["attention", "MAX_SEQLEN"]

MAX_SEQLEN = 512  # longest sample (keys) run here; longer ones go to SDPA's blocked flash kernel


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale):
        cu_k = cu_q if cu_k is None else cu_k  # None: the query offsets (see `attention`)
        out, lse = _ops().varlen_attention_fwd(q, k, v, cu_q, cu_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _ops().varlen_attention_bwd(grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _longest(cu: torch.Tensor, hint: Optional[int]) -> int:
    if hint is not None:
        return int(hint)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


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
    """Public-signature attention (contract: kernels/reference/attention.py); see the module docstring."""
    def sdpa():
        return _sdpa_attention(q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=window,
                               softmax_scale=softmax_scale, key_padding_mask=key_padding_mask)

    if q.dim() != 3 or key_padding_mask is not None or not _fits(q, k, v):
        return sdpa()
    cu_q, cu_k, left, right, scale = prepare_attention_args(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
    plain = left < 0 and (right < 0 or (causal and right == 0))
    head_dim = q.shape[-1]
    if (not plain or head_dim % 8 or head_dim > 512 or cu_q.device.type != "cpu" or cu_k.device.type != "cpu"
            or _longest(cu_k, max_seqlen_k) > MAX_SEQLEN):
        return sdpa()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _needs_grad(q, k, v):
        # self-attention passes one tensor for both offsets: handed over once, as torch.compile cannot trace an
        # autograd.Function given the same tensor twice (it would break the graph at every layer)
        return _VarlenAttention.apply(q, k, v, cu_q, None if cu_k is cu_q else cu_k, bool(causal), float(scale))
    return _ops().varlen_attention_fwd(q, k, v, cu_q, cu_k, bool(causal), float(scale))[0]
