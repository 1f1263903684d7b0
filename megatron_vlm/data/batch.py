"""The one batch schema every loop, loader and engine speaks.

A batch is a dict of tensors. Model inputs (`MODEL_INPUT_KEYS`, all optional but `input_ids`):

- `input_ids` [B, T] (packed: B = 1, samples back to back), `attention_mask` [B, T] (padded batches),
  `position_ids` (3, B, T) M-RoPE or [B, T], `cu_seqlens` [n + 1] int32 sample boundaries of a pack,
  `prefix_segments` [n] (packs whose segments continue a shared prompt: models/common/prefix_sharing.py);
- vision (`VISION_KEYS`): `pixel_values` (flattened patches or tiles, concatenated over the batch's
  images in order), `image_grid_thw` [n_images, 3], `pixel_values_videos`, `video_grid_thw`,
  `second_per_grid_ts` [n_videos].

Training targets: `labels` [B, T], already shifted (labels[t] is the token predicted at t, -100 =
not trained, see `shifted_labels`). Bookkeeping that never reaches the model: `num_samples`,
`num_label_tokens`, `sample_valid`, `answers`, `meta`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.host_copies import on_host

__all__ = ["IGNORE_INDEX", "VISION_KEYS", "MODEL_INPUT_KEYS", "SampleInputs", "shifted_labels", "model_inputs",
           "label_positions"]

IGNORE_INDEX = -100

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", *VISION_KEYS, "position_ids", "cu_seqlens", "prefix_segments")


@dataclass
class SampleInputs:
    """One sample's model inputs before batching: token ids with the image / video placeholders expanded and
    the vision tensors (`VISION_KEYS`) of that sample only, None where it has none. The fields that a
    processed training sample (data/processing.py) and a rollout prompt (inference/engine.py) share."""

    input_ids: torch.Tensor
    """[T] int64 token ids (placeholders expanded)."""
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None
    second_per_grid_ts: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def model_inputs(batch: dict) -> dict:
    """The model-input entries of `batch` that are present (None values dropped)."""
    return {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat positions of the trained labels (not IGNORE_INDEX) of `labels`, on its device: found on its host
    copy (megatron_vlm/host_copies.py) and moved without waiting. Indexing by them selects what
    `labels != IGNORE_INDEX` selects, in order, without the read of the mask's count (a sync on CUDA)."""
    positions = torch.nonzero(on_host(labels).reshape(-1) != IGNORE_INDEX).flatten()
    return positions.to(labels.device, non_blocking=True)


def shifted_labels(input_ids: torch.Tensor, label_mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N] labels of one sequence or one pack: labels[i] = input_ids[i + 1] where token i + 1 is a
    trained token (`label_mask`) of the same sequence, else -100; the last position of every sequence
    is -100, so no label crosses a sample boundary. The first token of a sequence cannot be trained
    (nothing predicts it): asking for it is an error rather than a silently dropped label."""
    if input_ids.dim() != 1 or label_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and label_mask {tuple(label_mask.shape)} must be one packed [N] shape"
        )
    if label_mask.dtype != torch.bool:
        raise ValueError(f"label_mask: must be bool, got {label_mask.dtype}")
    n = input_ids.numel()
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if n < 2:
        return labels
    nxt = label_mask[1:].clone()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens: must rise from 0 to N = {n}, got {cu.tolist()[:8]}")
        if bool(label_mask[cu[:-1].clamp_max(n - 1)].any()):
            raise ValueError("label_mask: the first token of a sequence cannot be trained (nothing predicts it)")
        last = cu[1:-1] - 1  # final position of every sequence but the last: its next token belongs to another
        nxt[last[last >= 0]] = False
    elif bool(label_mask[0]):
        raise ValueError("label_mask: the first token cannot be trained (nothing predicts it)")
    labels[:-1] = torch.where(nxt, input_ids[1:], torch.full_like(input_ids[1:], IGNORE_INDEX))
    return labels
