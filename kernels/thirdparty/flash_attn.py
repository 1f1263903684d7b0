"""`attention` on the flash-attn package (Dao-AILab), chosen by `auto` on CUDA for fp16 / bf16 when installed.

Our conventions are flash-attn's (bottom-right causal, window=(left, right) with -1 unbounded,
Hkv dividing Hq), so the mapping is direct: packed -> `flash_attn_varlen_func(q, k, v,
cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=, causal=, window_size=)`,
batched -> `flash_attn_func`. flash-attn has no key padding mask for the batched layout, so such
calls go to our Triton kernel, which has one.
"""
from typing import Optional, Tuple

import torch

from ..reference.attention import check_attention_inputs, normalize_window


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
    """Public-signature attention on flash-attn (contract: kernels/reference/attention.py)."""
    if key_padding_mask is not None:
        from ..triton.attention import attention as triton_attention

        return triton_attention(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask)
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    cu_seqlens_q, cu_seqlens_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, None)
    left, right = normalize_window(window, causal)
    window_size = (left, -1 if causal else right)  # flash-attn caps the right side itself when causal
    if q.dim() == 4:
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item())
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size,
    )
