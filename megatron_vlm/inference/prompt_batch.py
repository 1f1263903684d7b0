"""Rollout prompts as model inputs: left-padded token ids, their vision tensors, the vision tokens never sampled."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.data.packing import shapes_conflict, vision_shapes
from megatron_vlm.inference.engine import RolloutPrompt

__all__ = ["left_pad", "vision_inputs", "vision_token_ids"]


def left_pad(prompts: Sequence[RolloutPrompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [P, T], attention mask [P, T]) of the prompts left-padded to the longest: a prefill's last position is
    then every prompt's last token, whose logits draw the first generated one."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        n = len(p)
        if n == 0:
            raise ValueError(f"prompts[{i}]: empty prompt")
        ids[i, longest - n:] = p.input_ids.to(torch.long)
        mask[i, longest - n:] = 1
    return ids, mask


def vision_inputs(prompts: Sequence[RolloutPrompt]) -> dict:
    """Vision tensors of the prompts concatenated in prompt order. Prompts whose tensors cannot be concatenated
    (Nemotron-VL videos of two tile sizes) are never prefilled together (admission.py): a ValueError names them."""
    shapes: dict = {}
    for i, p in enumerate(prompts):
        if shapes_conflict(shapes, p):
            raise ValueError(f"prompts[{i}]: vision tensors of shapes {vision_shapes(p)} cannot be concatenated with "
                             f"{shapes} (one prefill takes prompts of one tile size)")
        shapes = {**vision_shapes(p), **shapes}
    out = {}
    for key in VISION_KEYS:
        parts = [getattr(p, key) for p in prompts if getattr(p, key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def vision_token_ids(model) -> list[int]:
    """The vision special tokens of a VLM (never sampled by a rollout engine); none for a text model."""
    args = getattr(model, "args", None)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(args, n)) for n in names if isinstance(getattr(args, n, None), int)]
