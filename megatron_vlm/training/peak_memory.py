"""`peak_memory_gib` of a train row: this rank's memory peak since the previous train row (the logging interval).

Why per interval: a peak since the process started repeats the first large step's figure in every later row, so
a row cannot tell which interval peaked. The loop reads the peak when it logs a row and resets it then.

- CUDA / NPU: the allocator's peak of tensors on the device (`max_memory_allocated`), reset with
  `reset_peak_memory_stats`.
- CPU on Linux: the process's peak resident set (VmHWM of /proc/self/status), reset by writing 5 to
  /proc/self/clear_refs (the kernel's documented reset of the peak RSS).
- CPU elsewhere (or where that reset is refused): the peak RSS since the process started (`ru_maxrss`), which
  cannot be reset; a warning says so once, and `since_start` is True.
"""
from __future__ import annotations

import logging
import re
import resource
import sys

import torch

__all__ = ["PeakMemory"]

log = logging.getLogger("megatron_vlm")

_PROC = "/proc/self"


class PeakMemory:
    """Read (`read_gib`) and restart (`reset`) the memory peak of `device` for this process."""

    def __init__(self, device: torch.device):
        self.device = device
        self.since_start = False
        """True once the CPU peak turned out not to be resettable here: the values are peaks since the start."""

    def reset(self) -> None:
        """Start a new interval: the next `read_gib` covers what runs from now on."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "npu":
            torch.npu.reset_peak_memory_stats(self.device)  # type: ignore[attr-defined]
        elif not self.since_start:
            try:
                with open(f"{_PROC}/clear_refs", "w") as f:
                    f.write("5")
            except OSError as e:
                self.since_start = True
                log.warning("peak_memory_gib: the peak RSS cannot be reset here (%s); it is the peak since the "
                            "process started, not per logging interval", e)

    def read_gib(self) -> float:
        """The peak since the last `reset`, in GiB."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.device.type == "npu":
            return torch.npu.max_memory_allocated(self.device) / 2**30  # type: ignore[attr-defined]
        if not self.since_start:
            try:
                with open(f"{_PROC}/status") as f:
                    m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
                if m:
                    return int(m.group(1)) / 2**20
            except OSError:
                pass
            self.since_start = True
            log.warning("peak_memory_gib: no per-interval peak RSS here; it is the peak since the process started")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux
