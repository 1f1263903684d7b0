"""Scatter vision-encoder features into the placeholder tokens of the text embeddings.

A VLM's processor expands every image / video into as many placeholder tokens (e.g.
`<|image_pad|>`) as the encoder will produce features; this step replaces the embeddings at those
positions, in order, by the features. The counts must agree exactly: when they do not, the error
names both numbers and, when the per-sample split is known, the first sample where they diverge
(the usual causes are a truncated sample, a wrong `max_pixels`, or grids that do not belong to the
batch).

The counts are read from the host copies of `input_ids` and the grids (megatron_vlm/host_copies.py) where the
loader's batch has them: on CUDA a count read from the device would wait for the vision tower's kernels.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_vlm.host_copies import on_host


def _first_bad_sample(
    tokens_per_sample: list[int], features_per_item: Sequence[int]
) -> Optional[tuple[int, int, int]]:
    """(sample, its placeholder count, the features that the items in its place provide) or None."""
    item = 0
    for s, need in enumerate(tokens_per_sample):
        got = 0
        while got < need and item < len(features_per_item):
            got += int(features_per_item[item])
            item += 1
        if got != need:
            return s, need, got
    if item < len(features_per_item):  # features left over after the last sample
        return len(tokens_per_sample) - 1, tokens_per_sample[-1] if tokens_per_sample else 0, -1
    return None


def merge_vision_embeddings(
    inputs_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    placeholder_token_id: int,
    *,
    modality: str = "image",
    features_per_item: Optional[Sequence[int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Return inputs_embeds with `features` [N, hidden] written, in order, at `input_ids == placeholder_token_id`.

    inputs_embeds [B, T, hidden], input_ids [B, T]. `features_per_item` (tokens per image/video, in
    order) and `cu_seqlens` (packed samples) only refine the error message.
    """
    mask = input_ids == placeholder_token_id
    n_tokens = int((on_host(input_ids) == placeholder_token_id).sum())
    n_features = features.shape[0] if features.dim() > 1 else 0
    if features.dim() != 2 or features.shape[-1] != inputs_embeds.shape[-1]:
        raise ValueError(
            f"{modality} features must be [N, {inputs_embeds.shape[-1]}], got {tuple(features.shape)}"
        )
    if n_tokens != n_features:
        msg = (
            f"{modality} placeholder tokens and {modality} features do not match: {n_tokens} placeholder tokens "
            f"(token id {placeholder_token_id}) in input_ids but {n_features} {modality} features"
        )
        if cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            per_sample = [int(mask[0, a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            per_sample = mask.sum(dim=1).tolist()
        if features_per_item is not None:
            bad = _first_bad_sample(per_sample, list(features_per_item))
            if bad is not None:
                s, need, got = bad
                msg += (
                    f"; first mismatch at sample {s}: {need} placeholder tokens there but "
                    + (f"its {modality}s give {got} features" if got >= 0 else f"extra {modality} features remain after it")
                )
        elif len(per_sample) == 1:
            msg += " (sample 0)"
        raise ValueError(msg)
    if n_tokens == 0:
        return inputs_embeds
    return inputs_embeds.masked_scatter(mask.unsqueeze(-1), features.to(inputs_embeds.dtype))


# the forward inputs of the Qwen-VL vision towers: pixels, their grids
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def vision_inputs(args) -> tuple[tuple[str, str, Optional[int], str], ...]:
    """(pixels input, grid input, placeholder token id, modality) for images then videos: the order in which the
    Qwen-VL forwards embed them (`args` has `image_token_id` / `video_token_id`)."""
    return (("pixel_values", "image_grid_thw", args.image_token_id, "image"),
            ("pixel_values_videos", "video_grid_thw", args.video_token_id, "video"))


def embed_vision_inputs(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    inputs: dict,
    args,
    tower,
    *,
    merge_size: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    deepstack: bool = False,
) -> tuple[torch.Tensor, dict]:
    """The Qwen-VL vision towers' part of a forward (Qwen2.5-VL, Qwen3-VL, Nemotron-VL on the Qwen3-VL tower):
    for images then videos given in `inputs`, `tower(pixels, grid)` features written at their placeholders.

    Returns (embeddings, extra decoder kwargs): with `deepstack` the tower (Qwen3-VL's) returns (features,
    DeepStack levels), and the kwargs are
    `visual_index` (flat placeholder positions, each kind in order; the decoder's index_add makes the joint
    order irrelevant) and `deepstack_embeds` (one tensor per level), both None when no vision input was given."""
    indexes, stacks = [], []
    for name, grid_name, token_id, modality in vision_inputs(args):
        pixels, grid = inputs.get(name), inputs.get(grid_name)
        if pixels is None:
            continue
        if grid is None:
            raise ValueError(f"{name} given without its grid_thw ({grid_name})")
        if token_id is None:
            raise ValueError(f"{name} given, but config.json has no {modality}_token_id for its placeholders")
        out = tower(pixels if dtype is None else pixels.to(dtype), grid)
        feats, levels = out if deepstack else (out, None)
        embeds = merge_vision_embeddings(
            embeds, input_ids, feats, token_id, modality=modality,
            features_per_item=(on_host(grid).prod(-1) // merge_size**2).tolist(),
            cu_seqlens=cu_seqlens,
        )
        if deepstack:
            where = torch.nonzero((on_host(input_ids) == token_id).reshape(-1)).flatten()  # on the host copy
            indexes.append(where.to(input_ids.device, non_blocking=True))
            stacks.append(levels)
    if not deepstack:
        return embeds, {}
    return embeds, {
        "visual_index": torch.cat(indexes) if indexes else None,
        "deepstack_embeds": [torch.cat(level) for level in zip(*stacks)] if stacks else None,
    }
