"""`[rl] allocation`: how the processes of an asynchronous GRPO job split into rollout and training ranks.

Why a module of its own: the config loader (torch-free, also imported by reward worker processes)
checks the grammar, and the launcher needs the same parse to assign each process its role before
any process group exists.

Grammar (spaces ignored, the two parts in either order):

    rollout:N+train:M        N rollout ranks, M training ranks (N, M >= 1)
    <engine>:dN+dM           the AReaL spelling (`vllm:d32+d16`, `sglang:d4+d4`): the first part is the
                             generation back end with N data-parallel rollout ranks, the second the
                             trainer with M data-parallel ranks: the split of `rollout:N+train:M`, and
                             the engine name is kept (`Allocation.engine`) for the config check, which
                             accepts "vllm" only with `rl.rollout_backend = "vllm"` and refuses others

The training ranks are the first M processes (global ranks 0 .. M-1: rank 0, which logs, checkpoints
and exports, is a trainer), the rollout ranks the last N. N + M must equal the number of processes
(checked at launch, exit 2).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megatron_vlm.errors import ConfigError

__all__ = ["Allocation", "parse_allocation", "ALLOCATION_GRAMMAR"]

ALLOCATION_GRAMMAR = "'rollout:N+train:M' (or the AReaL spelling '<engine>:dN+dM', e.g. 'vllm:d32+d16')"

_PART = re.compile(r"^(rollout|train):(\d+)$")
_AREAL = re.compile(r"^([a-z_]+):d(\d+)\+d(\d+)$")


@dataclass(frozen=True)
class Allocation:
    rollout: int
    train: int
    engine: Optional[str] = None
    """The back end named by the AReaL spelling ("vllm" of "vllm:d32+d16"); None for rollout:N+train:M."""

    @property
    def world_size(self) -> int:
        return self.rollout + self.train

    def role_of(self, rank: int) -> tuple[str, int]:
        """("train" | "rollout", rank within the role) of global rank `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the allocation's {self.world_size} processes")
        return ("train", rank) if rank < self.train else ("rollout", rank - self.train)


def parse_allocation(text: str) -> Allocation:
    """Parse `text` (grammar in the module docstring); ValueError naming the grammar otherwise."""
    s = "".join(str(text).split()).lower()
    m = _AREAL.match(s)
    if m and m.group(1) not in ("rollout", "train"):
        n, k = int(m.group(2)), int(m.group(3))
        if n < 1 or k < 1:
            raise ConfigError(f"allocation: {text!r}: both sizes must be >= 1")
        return Allocation(rollout=n, train=k, engine=m.group(1))
    parts = s.split("+")
    sizes: dict[str, int] = {}
    for p in parts:
        pm = _PART.match(p)
        if pm is None or pm.group(1) in sizes:
            raise ConfigError(f"allocation: {text!r} does not follow {ALLOCATION_GRAMMAR}")
        sizes[pm.group(1)] = int(pm.group(2))
    if set(sizes) != {"rollout", "train"}:
        raise ConfigError(f"allocation: {text!r} does not follow {ALLOCATION_GRAMMAR}")
    if sizes["rollout"] < 1 or sizes["train"] < 1:
        raise ConfigError(f"allocation: {text!r}: both sizes must be >= 1")
    return Allocation(rollout=sizes["rollout"], train=sizes["train"])
