"""Count the host reads of tensor values a piece of code makes: `HostReads`, a torch function mode.

Why: on CUDA each read of a device tensor's value (`item`, `tolist`, `bool()`, `float()`, indexing by a bool mask,
...) and each blocking upload (`torch.tensor(values, device=...)`) is a stream sync: the host waits until every
kernel queued before it has run, so it cannot launch the next step's kernels while the GPU works. Those reads can
be counted without a GPU: the same Python runs on the CPU. Used by the SFT step's regression test and by
benchmarks/e2e/bench_host_overhead.py.
"""
from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads", "READS"]

READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float", torch.Tensor.__int__: "int", torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy", torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "shape", torch.masked_select: "shape", torch.bincount: "shape",
    torch.Tensor.bincount: "shape", torch.unique: "shape", torch.Tensor.unique: "shape",
}
"""Reads of tensor values; "shape": ops whose output size depends on the values (the host reads it)."""

_TORCH_DIR = str(Path(torch.__file__).parent)
_REPO = str(Path(__file__).resolve().parents[2])


def _is_mask(index: Any) -> bool:
    """An index that selects by a bool tensor (its output size is the count of True: a host read on CUDA)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


def _read_kind(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    kind = READS.get(func)
    if kind is not None:
        return kind
    if func is torch.tensor and kwargs.get("device") is not None:
        return "upload"
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1 and _is_mask(args[1]):
        return "mask"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and kwargs.get("output_size") is None and (
            (len(args) > 1 and torch.is_tensor(args[1])) or torch.is_tensor(kwargs.get("repeats"))):
        return "shape"
    return None


def call_site() -> str:
    """`file:line function` of the innermost frame outside torch, with torch's frame that made the read when the
    read happened inside torch."""
    frames = traceback.extract_stack()[:-3]  # this function, _record, __torch_function__
    outside = [f for f in frames if not f.filename.startswith(_TORCH_DIR)]
    f = outside[-1] if outside else frames[-1]
    name = os.path.relpath(f.filename, _REPO) if f.filename.startswith(_REPO) else f.filename
    inner = frames[-1]
    via = ""
    if inner is not f and inner.filename.startswith(_TORCH_DIR):
        via = f" (in torch/{os.path.relpath(inner.filename, _TORCH_DIR)}:{inner.lineno} {inner.name})"
    return f"{name}:{f.lineno} {f.name}{via}"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values (`READS`; indexing by a bool mask: "mask") and uploads made with
    `torch.tensor(..., device=...)` ("upload"), by (kind, call site), in `sites`.

    `host`: tensors that live on the host in a GPU job too (a loader's pack before it moves to the device); reads of
    them are not counted. Count inside `with HostReads() as reads:`; `sites` may be swapped between steps."""

    def __init__(self, host: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.host = list(host)  # kept alive, so that their ids stay theirs
        self._host_ids = {id(t) for t in self.host}
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _read_kind(func, args, kwargs)
        if kind is not None and not (args and id(args[0]) in self._host_ids):
            self._record(kind)
        return func(*args, **kwargs)

    def _record(self, kind: str) -> None:
        self.sites[(kind, call_site())] += 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def report(self) -> str:
        """One line per (kind, call site), most frequent first."""
        return "\n".join(f"{n:4d} {kind:7s} {site}" for (kind, site), n in self.sites.most_common())
