"""3-D (temporal, height, width) M-RoPE position ids of Qwen-VL language models.

Semantics are those of the original Qwen2.5-VL `get_rope_index` (the Qwen team's code as added to transformers,
PR #35569, and kept up to transformers 5.2), which the released checkpoints were trained with and which vLLM keeps:

* a sequence is split into runs of equal token type (0 text, 1 image, 2 video); each image/video
  run consumes the next `[t, h, w]` grid (images and videos in their own order, across the batch);
* a text run of length n gets positions `p, p+1, ..., p+n-1` on all three rows;
* a vision run gets `t_pos = p + int(i_t * interval)`, `h_pos = p + i_h`, `w_pos = p + i_w` over the
  merged grid (h/merge, w/merge), with `interval = tokens_per_second * second_per_grid_ts[video]` for
  videos and 1 for images;
* every run after the first starts at the previous run's largest position + 1.

For images (t = 1) and Qwen3-VL's one-frame video runs the largest position is p + max(h, w)/merge - 1, so
the next run starts at p + max(h, w)/merge. A Qwen2.5-VL video whose temporal extent
int((t - 1) * interval) reaches max(h, w)/merge ends later: transformers 5.3+ resume the text at
p + max(h, w)/merge anyway (a regression, huggingface/transformers#45381); the original rule resumes it after
the video's last frame, as here.

The temporal index is quantised as vLLM does it: `int(i_t * interval)` in float64 (the interval being
tokens_per_second times the float32 second_per_grid_ts the processor returns). The original multiplied in
float32, which truncates differently in rare cases where i_t * interval is within float32 rounding of an
integer (e.g. fps 0.3 with temporal patch 2: second_per_grid_t 6.666..., i_t = 3 gives 39 in float64, 40 in
float32); vLLM's rule is kept so rollouts and training agree. Fractional intervals (0.5 s at 2 tokens per
second: 0, 1, 2, ...) are quantised after the multiplication, never before (transformers#48669).

* padding (attention_mask == 0) is skipped and gets position 0; the per-sequence
  `rope_delta = max(position) + 1 - n_valid_tokens` lets decoding continue at
  `n_valid_tokens_so_far + rope_delta`.

Extensions over the reference: `mm_token_type_ids` is optional (derived from the placeholder token
ids when absent), and packed input (one row, `cu_seqlens`) restarts positions at every sample.

Cached decoding (`cached_mrope_position_ids`, shared by every M-RoPE family): the prefill computes
the full positions and stores each sample's `rope_delta` in the cache; later steps continue at
`n_valid_tokens_so_far + rope_delta`. A later chunk with images or videos (`appended_mrope_position_ids`) gets
its own index shifted to that next text position, and the deltas move on by the chunk's own.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch

from megatron_vlm import _ext
from megatron_vlm.host_copies import all_on_host


def mm_token_type_ids_from_input_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """0 for text, 1 for image placeholders, 2 for video placeholders (the processor's convention)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == image_token_id] = 1
    types[input_ids == video_token_id] = 2
    return types


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(type, start, end)] of maximal runs of equal values in a 1-D tensor."""
    n = types.numel()
    if n == 0:
        return []
    change = torch.nonzero(types[1:] != types[:-1]).flatten() + 1
    bounds = [0] + change.tolist() + [n]
    values = types[bounds[:-1]].tolist() if len(bounds) > 1 else []
    return [(int(values[i]), bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _vision_positions(
    start: int, grid_thw: Sequence[int], spatial_merge_size: int, interval: float, device
) -> tuple[torch.Tensor, int]:
    """(positions [3, t*h*w] of one vision run starting at `start`, the run's largest position)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    # float64 product then truncation, as vLLM does (`(indices * t_factor).astype(int64)`; module docstring)
    steps = [int(i * interval) for i in range(t)]
    t_pos = torch.tensor(steps, dtype=torch.long, device=device) + start
    h_pos = torch.arange(h, device=device) + start
    w_pos = torch.arange(w, device=device) + start
    tt, hh, ww = torch.meshgrid(t_pos, h_pos, w_pos, indexing="ij")
    last = start + max([*steps, h - 1, w - 1])
    return torch.stack([tt, hh, ww]).reshape(3, -1), last


def _sequence_positions(
    types: torch.Tensor,
    grids: dict[int, Iterator],
    video_intervals: Iterator[float],
    spatial_merge_size: int,
    where: str,
) -> torch.Tensor:
    """Positions [3, n] of one unpadded sequence whose token types are `types`."""
    device = types.device
    pieces = []
    pos = 0
    for kind, start, end in _runs(types):
        if kind == 0:
            pieces.append((torch.arange(end - start, device=device) + pos).expand(3, -1))
            pos += end - start
            continue
        if kind not in (1, 2):
            raise ValueError(f"{where}: mm_token_type_ids has value {kind}; expected 0 (text), 1 (image) or 2 (video)")
        name = "image" if kind == 1 else "video"
        grid = next(grids[kind], None)
        if grid is None:
            raise ValueError(f"{where}: more {name} placeholder runs than entries in {name}_grid_thw")
        interval = 1.0
        if kind == 2:
            interval = next(video_intervals, None)
            if interval is None:
                raise ValueError(f"{where}: more video placeholder runs than entries in second_per_grid_ts")
        vis, last = _vision_positions(pos, grid, spatial_merge_size, interval, device)
        if vis.shape[1] != end - start:
            raise ValueError(
                f"{where}: a {name} run has {end - start} placeholder tokens but its grid {list(map(int, grid))} "
                f"gives {vis.shape[1]} tokens after {spatial_merge_size}x{spatial_merge_size} merging"
            )
        pieces.append(vis)
        pos = last + 1  # the original rule: after the run's largest position (module docstring)
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long, device=device)
    return torch.cat(pieces, dim=1)


def get_mrope_position_ids(
    input_ids: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
    image_grid_thw: Optional[torch.Tensor] = None,
    video_grid_thw: Optional[torch.Tensor] = None,
    second_per_grid_ts: Optional[torch.Tensor | Sequence[float]] = None,
    attention_mask: Optional[torch.Tensor] = None,
    mm_token_type_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (position_ids [3, B, T] long, rope_deltas [S, 1] long).

    S is B for a padded batch and the number of samples for packed input (`cu_seqlens` given,
    input_ids [1, T]). Padding positions are 0. Grids are consumed in order over the whole batch.
    """
    compiled = _ext.mrope_position_ids(  # the C++ twin (csrc/); None: run below
        input_ids, image_token_id=image_token_id, video_token_id=video_token_id, spatial_merge_size=spatial_merge_size,
        tokens_per_second=tokens_per_second, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts, attention_mask=attention_mask, mm_token_type_ids=mm_token_type_ids,
        cu_seqlens=cu_seqlens)
    if compiled is not None:
        return compiled
    target = input_ids.device  # computed on the host copies when the batch has them (no device sync), moved back
    host = all_on_host(input_ids, image_grid_thw, video_grid_thw, attention_mask, mm_token_type_ids, cu_seqlens,
                       second_per_grid_ts if torch.is_tensor(second_per_grid_ts) else None)
    if host is not None:
        input_ids, image_grid_thw, video_grid_thw, attention_mask, mm_token_type_ids, cu_seqlens = host[:6]
        if host[6] is not None:
            second_per_grid_ts = host[6]
    if input_ids.dim() != 2:
        raise ValueError(f"get_mrope_position_ids: input_ids must be [B, T], got {tuple(input_ids.shape)}")
    if mm_token_type_ids is None:
        mm_token_type_ids = mm_token_type_ids_from_input_ids(input_ids, image_token_id, video_token_id)
    elif mm_token_type_ids.shape != input_ids.shape:
        raise ValueError(
            f"mm_token_type_ids shape {tuple(mm_token_type_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    batch, seq = input_ids.shape
    device = input_ids.device
    grids = {
        1: iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(()),
        2: iter(video_grid_thw.tolist()) if video_grid_thw is not None else iter(()),
    }
    if second_per_grid_ts is None:
        intervals = itertools.repeat(float(tokens_per_second))
    else:
        sec = second_per_grid_ts.tolist() if torch.is_tensor(second_per_grid_ts) else list(second_per_grid_ts)
        intervals = iter([tokens_per_second * s for s in sec])
    position_ids = torch.zeros(3, batch, seq, dtype=torch.long, device=device)
    deltas = []

    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"get_mrope_position_ids: packed input (cu_seqlens) needs batch size 1, got {batch}")
        if attention_mask is not None:
            raise ValueError("get_mrope_position_ids: pass either cu_seqlens (packed) or attention_mask (padded), not both")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != seq or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the sequence length {seq}")
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            pos = _sequence_positions(mm_token_type_ids[0, lo:hi], grids, intervals, spatial_merge_size, f"packed sample {s}")
            position_ids[:, 0, lo:hi] = pos
            deltas.append((int(pos.max()) + 1 if pos.numel() else 0) - (hi - lo))
    else:
        for b in range(batch):
            types = mm_token_type_ids[b]
            keep = None
            if attention_mask is not None:
                keep = attention_mask[b].bool()
                types = types[keep]
            pos = _sequence_positions(types, grids, intervals, spatial_merge_size, f"sample {b}")
            if keep is None:
                position_ids[:, b] = pos
            else:
                position_ids[:, b, keep] = pos
            deltas.append((int(pos.max()) + 1 if pos.numel() else 0) - types.numel())
    rope_deltas = torch.tensor(deltas, dtype=torch.long).unsqueeze(1)
    return position_ids.to(target, non_blocking=True), rope_deltas.to(target, non_blocking=True)


def cached_mrope_position_ids(
    input_ids: torch.Tensor,
    kv_cache,
    new_mask: Optional[torch.Tensor],
    prefill_positions: Callable[[Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """M-RoPE positions `[3, B, n_new]` of the new tokens of a cached forward.

    Prefill (empty cache): `prefill_positions(new_mask)` -> (position_ids, rope_deltas) (the family's
    full computation over the prompt and its grids); the deltas are stored in the cache. Later steps:
    text positions continue at (valid tokens so far) + rope_delta for each sample (new tokens are
    text; a generated placeholder id is embedded as a plain token, as transformers does); padding
    gets position 0. `kv_cache` has `seq_len`, `valid_lengths()`, `rope_deltas`, `set_rope_deltas`."""
    if kv_cache.seq_len == 0:
        position_ids, deltas = prefill_positions(new_mask)
        kv_cache.set_rope_deltas(deltas)
        return position_ids
    valid = new_mask.long() if new_mask is not None else torch.ones_like(input_ids)
    start = kv_cache.valid_lengths().unsqueeze(1)  # [B, 1] real tokens already cached
    pos = start + valid.cumsum(-1) - 1 + kv_cache.rope_deltas.to(input_ids.device)
    pos = pos.masked_fill(valid == 0, 0)
    return pos.unsqueeze(0).expand(3, -1, -1)


def appended_mrope_position_ids(
    kv_cache,
    new_mask: Optional[torch.Tensor],
    chunk_positions: Callable[[Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """M-RoPE positions `[3, B, n_new]` of new tokens holding vision placeholders, fed to a cache that holds tokens.

    Why not `cached_mrope_position_ids`: its later steps count the new tokens as text, which a chunk with an image
    or a video (a later turn) is not. The whole sequence's rule continues after the cached tokens at their largest
    position + 1 (= real tokens so far + rope delta) exactly as a sequence starts at 0, so the chunk's own index
    (`chunk_positions(new_mask)` -> (positions from 0, its deltas), with the chunk's grids) is shifted there, and
    each sample's delta grows by the chunk's (max + 1 - n of the chunk). Call before the cache's `begin_step`."""
    pos, deltas = chunk_positions(new_mask)
    start = kv_cache.valid_lengths().unsqueeze(1) + kv_cache.rope_deltas.to(pos.device)  # [B, 1]
    pos = pos + start.unsqueeze(0)
    if new_mask is not None:
        pos = pos.masked_fill(~new_mask.bool().unsqueeze(0), 0)
    kv_cache.set_rope_deltas(kv_cache.rope_deltas + deltas.to(kv_cache.rope_deltas.device))
    return pos
