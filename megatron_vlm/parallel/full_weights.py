"""A sharded model's weights as full tensors, a block at a time: for the copies a trainer refreshes or pushes.

Why a block at a time: gathering a whole FSDP-sharded state dict first holds a second full model (in the trainer's
master dtype) on every rank. The weight refreshes (the rollout engine's own copy, the vLLM engine's push, the
asynchronous weight push) walk the state dict in its order, gather each entry only when its block is reached (a
collective: every rank walks the same order) and drop it once copied. A block is a decoder or vision block
(`language_model.layers.3`, `visual.blocks.0`): the tensors a conversion fuses or splits (megatron-core layers'
native names, a family adapter's q / k / v) always lie in one. Every other entry goes with the module owning it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

__all__ = ["full_tensor", "block_groups"]

_BLOCK = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A state-dict entry as a full tensor: a sharded (DTensor) one gathered (a collective), others as they are."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def block_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """State-dict names (in their order) by the module they belong to: their block, else the module owning the
    entry (`lm_head` for `lm_head.weight`; "" for an entry of the root module)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _BLOCK.match(name)
        groups.setdefault(m.group(1) if m else name.rpartition(".")[0], []).append(name)
    return groups
