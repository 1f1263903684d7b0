"""The few collectives the training loops need, written once, as no-ops in a single process.

Every rank of a loop reaches each call in the same order (all ranks run the same number of steps,
micro-batches and decode steps), which is also what keeps FSDP's own collectives matched.
Values travel as float64 / int64 tensors on the job's device (NCCL / HCCL need device tensors). In a single
process the Python values come back as they are, with no tensor: on CUDA the upload and the read back are each a
stream sync, which makes the host wait for every kernel queued (tests/unit/training/test_step_host_reads.py). With
several ranks the values go up without waiting (`to_device`) and the read back is the one sync.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["world_size", "barrier", "all_reduce_", "all_reduce_sum", "all_reduce_max", "any_rank",
           "all_gather_objects", "to_device"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of a tensor over all ranks ("sum" or "max"); returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting for the device (a tensor made there from a list
    is a blocking upload: on CUDA it waits for every kernel queued)."""
    return torch.tensor(list(values), dtype=dtype).to(device, non_blocking=True)


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    if world_size() == 1:
        return [float(v) for v in values]
    return all_reduce_(to_device(values, torch.float64, device)).tolist()


def all_reduce_max(values: Sequence[int], device: torch.device) -> list[int]:
    """Element-wise max over ranks (int64)."""
    if world_size() == 1:
        return [int(v) for v in values]
    t = all_reduce_(to_device(values, torch.int64, device), op="max")
    return [int(v) for v in t.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is True on at least one rank."""
    return bool(all_reduce_max([int(flag)], device)[0])


def all_gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] (picklable, small objects: metrics, scores, bad records)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
