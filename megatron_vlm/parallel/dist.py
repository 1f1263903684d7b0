"""Process-group setup: picks the device (cuda / npu / cpu) and the matching backend
(nccl / hccl / gloo), under torchrun or as a plain single process.

A single plain-python process still gets a (one-rank, in-memory HashStore) process group so that the
same collective code runs for 1 and N processes (the device mesh, all-reduces of metrics); on the CPU its
model is FSDP2-wrapped only in bf16 (training/model_bundle.py `fsdp_needed`), so the 1-vs-2-process loss
equivalence tests compare plain parameters with FSDP2 shards. No port is opened in that case.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def detect_device(local_rank: int = 0, prefer: str = "auto") -> tuple[torch.device, str]:
    if prefer in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if prefer in ("auto", "npu") and _npu_available():
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank), "hccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout_s: int = 1800) -> DistEnv:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = detect_device(local_rank, os.environ.get("MEGATRON_VLM_DEVICE", "auto"))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ and world >= 1 and "RANK" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world, local_rank, device, backend)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # teardown must never mask the real error
            dist.destroy_process_group()
