"""Graceful stop on SIGTERM (SLURM preemption / time limit) and SIGUSR1 (SLURM's --signal warning):
the job saves a checkpoint at the next step boundary and exits 143. Ctrl-C (SIGINT) is not caught
here: it interrupts at once (no checkpoint; the runner tears down the process groups, exit 130), so
an interactive user is never kept waiting for a step to finish.

The handler only sets a flag; the loop checks it at a step boundary, and ranks agree through an
all-reduce (MAX) so every rank saves the same checkpoint step — a rank that stopped alone would
leave the others blocked in a collective.
"""
from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist

from megatron_vlm.stop_signals import STOP_SIGNALS


class StopFlag:
    def __init__(self):
        self.signum = 0
        self._prev = {}

    def install(self) -> StopFlag:
        for s in STOP_SIGNALS:
            self._prev[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.signum = signum

    def should_stop(self, device: torch.device) -> bool:
        flag = torch.tensor([1 if self.signum else 0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._prev.items():
            signal.signal(s, h)
