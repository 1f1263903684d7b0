"""The data-parallel coordinates of a GRPO step and its two collectives over the data shards.

Why its own object: the rounds (dynamic sampling's kept-group counts), the update (the global token /
sequence normaliser) and the step metrics all reduce over the data shards, and each must count a shard
once, not once per tensor-parallel rank of its group (tp ranks generate, score and train on the same
prompts).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_vlm.parallel.collectives import all_gather_objects, all_reduce_sum

__all__ = ["DataShards"]


@dataclass(frozen=True)
class DataShards:
    rank: int
    """This rank's data shard."""
    world: int
    """Number of data shards (the data-parallel size)."""
    copies: int
    """Ranks that hold each shard (the tensor-parallel size; 1 without tp)."""
    device: torch.device

    @classmethod
    def of(cls, dims: Any, rank: int, device: torch.device) -> DataShards:
        """From a bundle's `ParallelDims` (or a stand-in with `dp_size`); `rank` when it has no `dp_rank`."""
        return cls(rank=getattr(dims, "dp_rank", rank), world=dims.dp_size, copies=getattr(dims, "data_copies", 1),
                   device=device)

    def sum(self, values: Sequence[float], device: Optional[torch.device] = None) -> list[float]:
        """Element-wise sum over the data shards (each counted once, not once per tp rank)."""
        out = all_reduce_sum(values, device if device is not None else self.device)
        return out if self.copies == 1 else [v / self.copies for v in out]

    def gather(self, obj: Any) -> list[Any]:
        """[obj of data shard 0, obj of data shard 1, ...]: one rank per tp group (tp is the innermost
        mesh dim, so the group of world rank r is r // tp)."""
        return all_gather_objects(obj)[::self.copies]
