"""DeepStack (Qwen3-VL): vision features from intermediate ViT blocks added to the decoder's hidden
states at the vision placeholder positions, level j after decoder layer j.

Shared by every decoder that takes a Qwen3-VL vision tower (Qwen3-VL's own, Nemotron-VL's hybrid one).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def add_deepstack(
    x: torch.Tensor,
    layer_idx: int,
    visual_index: Optional[torch.Tensor],
    deepstack_embeds: Optional[Sequence[torch.Tensor]],
) -> torch.Tensor:
    """x `[..., H]` after decoder layer `layer_idx`; when `layer_idx < len(deepstack_embeds)`, returns x with
    `deepstack_embeds[layer_idx]` `[n, H]` added at the flattened token positions `visual_index` `[n]`
    (row-major over the leading dims); otherwise x unchanged."""
    if not deepstack_embeds or layer_idx >= len(deepstack_embeds):
        return x
    flat = x.reshape(-1, x.shape[-1]).index_add(0, visual_index, deepstack_embeds[layer_idx].to(x.dtype))
    return flat.view_as(x)
