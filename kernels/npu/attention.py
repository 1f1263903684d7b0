"""Ascend adapter for `attention` on `torch_npu.npu_fusion_attention`.

Mapping (torch_npu / CANN docs of npu_fusion_attention and its sparse_mode table):

* packed `[T, H, D]` -> input_layout "TND" with `actual_seq_qlen` / `actual_seq_kvlen` = the
  cumulative ends of the sequences (our cu_seqlens without the leading 0, as host int lists);
  batched `[B, S, H, D]` -> "BSND". `head_num` is the number of query heads; kv heads may divide
  it (GQA).
* Masks are True = masked out (the opposite of our key_padding_mask).
  - no causal / window / padding: sparse_mode 0 without a mask;
  - causal: sparse_mode 3 (rightDownCausal, our bottom-right alignment), with the compressed
    2048 x 2048 upper-triangular mask the op requires for sparse modes 2-4;
  - window (left, right): sparse_mode 4 (band, anchored bottom-right) with pre_tockens = left and
    next_tockens = right (0 when causal; 2147483647 for an unbounded side);
  - key_padding_mask (batched): sparse_mode 1 (allMask) with the full [B, 1, Sq, Sk] mask built here.
* Head dims must be multiples of 16 on the device: other D (72) are zero-padded for q / k / v,
  which leaves the scores unchanged (the scale is passed explicitly) and the extra output columns
  are dropped.
Autograd comes from torch_npu (the op has a registered backward).
"""
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference.attention import check_cu_seqlens_lists, prepare_attention_args, visible_mask
from ._torch_npu import torch_npu_module

UNBOUNDED = 2147483647
COMPRESSED_MASK_SIZE = 2048


@lru_cache(maxsize=8)
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048 x 2048 bool mask (True above the diagonal) sparse modes 2, 3 and 4 expect."""
    size = COMPRESSED_MASK_SIZE
    return torch.triu(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=1)


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
    """Public-signature attention on npu_fusion_attention (contract: kernels/reference/attention.py)."""
    torch_npu = torch_npu_module("attention")
    cu_seqlens_q, cu_seqlens_k, left, right, scale = prepare_attention_args(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
    head_dim = q.shape[-1]
    pad = (-head_dim) % 16
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    kwargs = dict(scale=scale, pre_tockens=UNBOUNDED, next_tockens=UNBOUNDED, sparse_mode=0, atten_mask=None)
    if key_padding_mask is not None:
        visible = visible_mask(q.shape[1], k.shape[1], causal, left, right, q.device)[None, None]
        kwargs.update(atten_mask=~(visible & key_padding_mask[:, None, None, :]), sparse_mode=1)
    elif left >= 0 or (right >= 0 and not causal):  # a band (causal alone has right == 0, left == -1)
        kwargs.update(
            atten_mask=compressed_causal_mask(q.device), sparse_mode=4,
            pre_tockens=left if left >= 0 else UNBOUNDED, next_tockens=right if right >= 0 else UNBOUNDED,
        )
    elif causal:
        kwargs.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=3)
    if q.dim() == 3:
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # host lists for the op; checked here, as it does not
        check_cu_seqlens_lists(bq, bk, q.shape[0], k.shape[0])
        out = torch_npu.npu_fusion_attention(
            q, k, v, q.shape[1], "TND", actual_seq_qlen=bq[1:], actual_seq_kvlen=bk[1:], **kwargs,
        )[0]
    else:
        out = torch_npu.npu_fusion_attention(q, k, v, q.shape[2], "BSND", **kwargs)[0]
    return out[..., :head_dim] if pad else out
