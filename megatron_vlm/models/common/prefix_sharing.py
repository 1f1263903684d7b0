"""Packed training forwards in which a prompt shared by several completions is computed once.

Why: a GRPO group is G completions of one prompt, and the training forwards (policy update, old and
reference log-probs) otherwise pack G copies of that prompt — for a VLM prompt with a 1k-token image
and short answers, almost all of the work. Here a pack is a list of segments (`cu_seqlens`) and
`prefix_segments[s]` names the segment that segment s continues (-1: none):

* a *prefix* segment holds the prompt without its last token and continues nothing;
* a *continuation* segment holds the prompt's last token followed by one completion, so labels shift
  inside every segment exactly as in plain packing (the log-prob of a completion's first token is read
  at that segment's first position).

Attention: segment s attends to the keys of its prefix segment followed by its own keys, causally
aligned bottom-right (`kernels.attention` with separate `cu_seqlens_k`, a contract every backend
keeps): the keys, values and positions the unshared sequence prompt + completion would see. K / V are
gathered per layer (`PrefixLayout.gather`); every projection, MLP and the vision tower run once per
prompt, and the gradients of the shared prompt are the sum over its continuations, as unshared.

Positions: the family computes positions per segment as for plain packing (a continuation segment is
plain text, so 0..L-1 on every axis), then `shift_positions` moves every continuation by the largest
position of its prefix + 1 — the rule by which text continues after a prompt in RoPE and in M-RoPE
(`get_rope_index`). That holds only when the prompt's last token is text, so the packer
(`megatron_vlm.rl.batching`) never splits a prompt that ends in a vision placeholder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.host_copies import move, on_host

__all__ = ["PrefixLayout", "prefix_layout_and_positions", "shift_positions", "accepts_prefix_segments"]


def _bounds(cu_seqlens: torch.Tensor, prefix_segments: torch.Tensor) -> tuple[list[int], list[int]]:
    """Read from the host copies when the batch has them (megatron_vlm/host_copies.py: no device sync)."""
    bounds = [int(b) for b in on_host(cu_seqlens).tolist()]
    prefix = [int(p) for p in on_host(prefix_segments).tolist()]
    if len(prefix) != len(bounds) - 1:
        raise ValueError(f"prefix_segments: {len(prefix)} entries for {len(bounds) - 1} segments (cu_seqlens)")
    for s, p in enumerate(prefix):
        if p < -1 or p >= s:
            raise ValueError(f"prefix_segments[{s}] = {p}: must be -1 or an earlier segment")
        if p >= 0 and prefix[p] != -1:
            raise ValueError(f"prefix_segments[{s}] = {p}: segment {p} continues another segment itself")
    return bounds, prefix


@dataclass
class PrefixLayout:
    """The key side of a prefix-shared pack: `kv_index` [Tk] picks, for every segment in order, its
    prefix's tokens then its own; `cu_seqlens_k` bounds those key sequences."""

    kv_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, prefix_segments: torch.Tensor) -> PrefixLayout:
        bounds, prefix = _bounds(cu_seqlens, prefix_segments)
        dev = cu_seqlens.device  # built on the host, moved without waiting for the device
        pieces, lengths = [], []
        for s, p in enumerate(prefix):
            own = torch.arange(bounds[s], bounds[s + 1])
            if p >= 0:
                own = torch.cat([torch.arange(bounds[p], bounds[p + 1]), own])
            pieces.append(own)
            lengths.append(int(own.numel()))
        cu_k = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return cls(index.to(dev, non_blocking=True), move(cu_k, dev), max(lengths, default=0))

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed k / v [T, H, D] -> the key sequences [Tk, H, D] (differentiable: index_select)."""
        return k.index_select(0, self.kv_index), v.index_select(0, self.kv_index)


def shift_positions(position_ids: torch.Tensor, cu_seqlens: torch.Tensor, prefix_segments: torch.Tensor) -> torch.Tensor:
    """position_ids [..., T] computed per segment -> continuation segments moved behind their prefix
    (max over the prefix's positions on every axis, + 1)."""
    bounds, prefix = _bounds(cu_seqlens, prefix_segments)
    if position_ids.shape[-1] != bounds[-1]:
        raise ValueError(f"position_ids: {position_ids.shape[-1]} positions for a pack of {bounds[-1]} tokens")
    out = position_ids.clone()
    for s, p in enumerate(prefix):
        if p >= 0 and bounds[p + 1] > bounds[p]:
            out[..., bounds[s]:bounds[s + 1]] += position_ids[..., bounds[p]:bounds[p + 1]].max() + 1
    return out


def prefix_layout_and_positions(
    position_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor], prefix_segments: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[PrefixLayout]]:
    """What a family forward does with `prefix_segments`: (shifted positions, the attention layout);
    unchanged positions and None without it."""
    if prefix_segments is None:
        return position_ids, None
    if cu_seqlens is None:
        raise ValueError("prefix_segments needs packed input (cu_seqlens)")
    return shift_positions(position_ids, cu_seqlens, prefix_segments), PrefixLayout.build(cu_seqlens, prefix_segments)


def accepts_prefix_segments(model) -> bool:
    """Whether the family model's forward takes `prefix_segments` (attention-only decoders do; a
    recurrent Mamba2 layer cannot start a continuation from its prompt's state, so Nemotron-VL does not)."""
    takes = getattr(model, "takes_input", None)  # the family models (models/common/vlm_base.py)
    if takes is not None:
        return bool(takes("prefix_segments"))
    import inspect

    return "prefix_segments" in inspect.signature(model.forward).parameters
