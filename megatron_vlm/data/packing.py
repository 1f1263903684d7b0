"""First-fit packing of samples into token budgets, and the pack / padded-batch collates.

A pack is one row of up to `max_tokens_per_pack` tokens holding several samples back to back;
attention is confined to each sample through `cu_seqlens` (the model restarts M-RoPE positions per
sample from input_ids, the grids and cu_seqlens). Packs carry no padding, so compute scales with
real tokens; efficiency = real tokens / (packs x capacity) is tracked by the loader.

Labels are already shifted: labels[t] is the token to predict at position t — input_ids[t + 1]
when that token is a trained assistant token, else -100 — and the last position of every sample is
-100, so no label crosses a sample boundary.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_vlm import _ext
from megatron_vlm.data.batch import IGNORE_INDEX, VISION_KEYS, shifted_labels
from megatron_vlm.data.processing import ProcessedSample

__all__ = ["first_fit_pack", "first_fit_pack_classes", "collate_pack", "collate_padded", "empty_pack",
           "vision_shape_conflict", "vision_shapes", "shapes_conflict"]



def first_fit_pack(lengths: Sequence[int], order: Sequence[int], capacity: int, max_open: int = 64) -> list[list[int]]:
    """Place samples (visited in `order`) into the first open pack with room; packs are returned in
    the order they were opened. At most `max_open` packs stay open (the oldest is closed when a new
    one would exceed that), which keeps the cost O(n * max_open) and the order close to `order`.
    Every sample must fit alone (lengths[i] <= capacity)."""
    packs = _ext.first_fit_pack(lengths, order, capacity, max_open)  # compiled twin (csrc/); None: run below
    if packs is not None:
        return packs
    return _first_fit(lengths, None, order, capacity, max_open)


def first_fit_pack_classes(lengths: Sequence[int], classes: Sequence[int], order: Sequence[int], capacity: int,
                           max_open: int = 64) -> list[list[int]]:
    """`first_fit_pack` where a sample of pack class c != 0 (`processing.pack_class`: a video whose tensor keeps its
    own shape) only joins a pack whose samples are of class c or 0, and a class-0 sample joins any pack with room.
    Why: such videos cannot be concatenated into one pack; planned apart, none has to be dropped when the pack is
    built. With every class 0 the plan is `first_fit_pack`'s."""
    return _first_fit(lengths, classes, order, capacity, max_open)


def _first_fit(lengths: Sequence[int], classes: Optional[Sequence[int]], order: Sequence[int], capacity: int,
               max_open: int) -> list[list[int]]:
    """The one first-fit loop of both planners (`classes` None: every sample of class 0)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    packs: list[list[int]] = []
    room: list[int] = []
    kind: list[int] = []  # the pack's class: 0 until a sample of another class joins
    open_ids: list[int] = []
    for i in order:
        n, c = int(lengths[i]), (int(classes[i]) if classes is not None else 0)
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than the pack capacity {capacity}")
        if n <= 0:
            raise ValueError(f"sample {i} has length {n}")
        for p in open_ids:
            if room[p] >= n and (c == 0 or kind[p] in (0, c)):
                packs[p].append(i)
                room[p] -= n
                kind[p] = kind[p] or c
                if room[p] == 0:
                    open_ids.remove(p)
                break
        else:
            packs.append([i])
            room.append(capacity - n)
            kind.append(c)
            if room[-1] > 0:
                open_ids.append(len(packs) - 1)
                if len(open_ids) > max_open:
                    open_ids.pop(0)
    return packs


def vision_shape_conflict(samples: Sequence[Any], candidate: Any) -> Optional[str]:
    """Why `candidate` cannot join `samples` in one pack, or None. Vision tensors are concatenated
    along dim 0, so their other dims must agree: always true for flattened patches (Qwen, Nemotron
    images) and fixed-size tiles (InternVL), but Nemotron-VL video frames keep their per-video
    tile size [frames, 3, H, W]. Each item holds vision inputs as attributes (a `ProcessedSample`, a
    rollout prompt) or as a dict (a multi-turn response's vision)."""
    for key in VISION_KEYS:
        mine = _vision_of(candidate, key)
        if mine is None:
            continue
        for s in samples:
            other = _vision_of(s, key)
            if other is not None and other.shape[1:] != mine.shape[1:]:
                return f"{key} of shape [*, {', '.join(map(str, mine.shape[1:]))}] cannot be packed with " \
                       f"[*, {', '.join(map(str, other.shape[1:]))}]"
    return None


def vision_shapes(item: Any) -> dict[str, tuple[int, ...]]:
    """The trailing dims (all but dim 0) of each vision tensor of `item` (as `vision_shape_conflict` reads it): two
    items can share a pack when they agree on every key both have, so a group of items that can is described by
    the first shape seen per key (a cheap test for long groups: `shapes_conflict`)."""
    return {k: tuple(v.shape[1:]) for k in VISION_KEYS if (v := _vision_of(item, k)) is not None}


def shapes_conflict(shapes: dict[str, tuple[int, ...]], item: Any) -> bool:
    """Whether `item` cannot join a group whose `vision_shapes` (merged) are `shapes`."""
    return any(shapes.get(k, s) != s for k, s in vision_shapes(item).items())


def _vision_of(item: Any, key: str) -> Optional[torch.Tensor]:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


def _cat_vision(samples: Sequence[ProcessedSample]) -> dict[str, torch.Tensor]:
    out = {}
    for key in VISION_KEYS:
        parts = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if parts:
            out[key] = torch.cat(parts, dim=0)
    return out


def collate_pack(samples: Sequence[ProcessedSample]) -> dict:
    """Concatenate samples into one pack: input_ids / labels [1, T], cu_seqlens int32 [n+1], vision
    tensors concatenated in sample order, num_samples, num_label_tokens (int64 scalars)."""
    if not samples:
        raise ValueError("collate_pack: no samples")
    ids = torch.cat([s.input_ids for s in samples])
    labels = torch.cat([shifted_labels(s.input_ids, s.label_mask) for s in samples])
    lens = torch.tensor([len(s) for s in samples], dtype=torch.int32)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return {
        "input_ids": ids.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "cu_seqlens": cu,
        **_cat_vision(samples),
        "num_samples": torch.tensor(len(samples)),
        "num_label_tokens": (labels != IGNORE_INDEX).sum(),
    }


def empty_pack(pad_token_id: int) -> dict:
    """A one-token pack with nothing to train on: what a rank yields when every sample planned for
    its pack turned out bad, so that all ranks still run the same number of forward passes."""
    return {
        "input_ids": torch.tensor([[pad_token_id]]),
        "labels": torch.tensor([[IGNORE_INDEX]]),
        "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32),
        "num_samples": torch.tensor(0),
        "num_label_tokens": torch.tensor(0),
    }


def collate_padded(samples: Sequence[ProcessedSample], pad_token_id: int, *, padding_side: str = "right",
                   image_token_id: Optional[int] = None, video_token_id: Optional[int] = None) -> dict:
    """Unpacked batch for evaluation / generation: input_ids, attention_mask, labels (shifted, -100 on
    padding) [B, T_max], vision tensors concatenated in sample order; mm_token_type_ids (0 text,
    1 image, 2 video) when the placeholder ids are given. Samples whose vision tensors cannot be
    concatenated (Nemotron-VL videos of two tile sizes: `vision_shape_conflict`) give each row's own
    instead, as `row_vision` (one dict per row), for a consumer that runs them apart (the rollout engine)."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if not samples:
        raise ValueError("collate_padded: no samples")
    t_max = max(len(s) for s in samples)
    b = len(samples)
    ids = torch.full((b, t_max), pad_token_id, dtype=torch.long)
    labels = torch.full((b, t_max), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((b, t_max), dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s)
        sl = slice(0, n) if padding_side == "right" else slice(t_max - n, t_max)
        ids[r, sl] = s.input_ids
        labels[r, sl] = shifted_labels(s.input_ids, s.label_mask)
        attn[r, sl] = 1
    out = {"input_ids": ids, "attention_mask": attn, "labels": labels}
    if any(vision_shape_conflict(samples[:i], s) for i, s in enumerate(samples)):
        out["row_vision"] = [{k: v for k in VISION_KEYS if (v := getattr(s, k)) is not None} for s in samples]
    else:
        out.update(_cat_vision(samples))
    if image_token_id is not None and video_token_id is not None:
        mm = torch.zeros_like(ids)
        mm[(ids == image_token_id) & (attn == 1)] = 1
        mm[(ids == video_token_id) & (attn == 1)] = 2
        out["mm_token_type_ids"] = mm
    return out
