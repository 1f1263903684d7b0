"""The few collectives the GRPO loop needs, as no-ops in a single process.

Every rank of the loop reaches each call in the same order (all ranks run the same number of
steps, mini-batches and micro-batches), which is what keeps FSDP's own collectives matched too.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["world_size", "all_reduce_sum", "all_reduce_max", "any_rank", "all_gather_objects"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise max over ranks."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is True on at least one rank."""
    return bool(all_reduce_max([int(flag)], device)[0])


def all_gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] (picklable, small objects: metrics, scores)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
