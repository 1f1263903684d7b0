"""1-D RoPE positions of text-only decoders (Qwen2 / Qwen3) for the three input forms of `forward`.

The VLMs derive 3-D M-RoPE positions from the vision grids (`mrope_index.py`); a text-only model
needs only token counts, with the same conventions so that every input form gives the logits a
sample would get alone:

* padded batch: position = real tokens before it (`cumsum(mask) - 1`), so a left-padded prompt has
  the positions it has unpadded; padding gets 0 (it is masked out anyway);
* packed (`cu_seqlens`): positions restart at 0 for every sample;
* cached decoding: the new tokens continue at the number of real tokens already cached.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_vlm.host_copies import on_host


def text_position_ids(
    input_ids: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    kv_cache=None,
) -> torch.Tensor:
    """Positions [B, T] (long) of `input_ids` [B, T]. With `kv_cache` (before its `begin_step`),
    `attention_mask` covers the new tokens only; `kv_cache.valid_lengths()` gives the offset."""
    b, t = input_ids.shape
    device = input_ids.device
    if cu_seqlens is not None:
        # on the host copy when the batch has one (megatron_vlm/host_copies.py: no device sync), moved back
        cu = on_host(cu_seqlens).to(dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != t or bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens {cu.tolist()} must rise from 0 to the sequence length {t}")
        starts = torch.repeat_interleave(cu[:-1], lengths)
        return (torch.arange(t, device=cu.device) - starts).unsqueeze(0).to(device, non_blocking=True)
    valid = attention_mask.long() if attention_mask is not None else torch.ones(b, t, dtype=torch.long, device=device)
    pos = valid.cumsum(-1) - 1
    if kv_cache is not None and kv_cache.seq_len > 0:
        pos = pos + kv_cache.valid_lengths().to(device).unsqueeze(1)
    return pos.masked_fill(valid == 0, 0)
