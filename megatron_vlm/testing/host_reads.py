"""Count the host reads of tensor values a piece of code makes: `HostReads`, a torch function mode.

Why: on CUDA each read of a device tensor's value (`item`, `tolist`, `bool()`, `float()`, indexing by a bool mask,
...) and each blocking upload (`torch.tensor(values, device=...)`) is a stream sync: the host waits until every
kernel queued before it has run, so it cannot launch the next step's kernels while the GPU works. Those reads can
be counted without a GPU: the same Python runs on the CPU. Used by the steps' regression tests
(tests/unit/training/test_step_host_reads.py, tests/unit/rl/test_update_host_reads.py) and by
benchmarks/e2e/bench_host_overhead.py.

Which tensors are host tensors, on a machine where everything is on the CPU: those given as `host` (a loader's
pack, a sample's log-probs), and what is computed from host tensors alone or made without a `device` argument (a
GPU job computes those on its CPU too: `torch.arange(n)`, `host_ids == token_id`, `.cpu()`'s or `.to("cpu")`'s
result); a `.to` naming another device (or a `torch.device`) gives a device tensor. Reading a host tensor is free;
moving one to a device without `non_blocking=True` is a blocking upload ("upload": on CUDA it waits for the
stream). Blind spots, where everything is on the CPU: a `.to(device)` of a host tensor without `non_blocking`
(or `copy`) moves it nowhere there and is taken for a host computation's (its result stays a host tensor, a blocking
upload is not seen): code moves host tensors with `non_blocking=True`; and such a move may return the tensor
itself, which then stays a host tensor.
"""
from __future__ import annotations

import collections
import os
import traceback
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["HostReads", "READS"]

READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float", torch.Tensor.__int__: "int", torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu", torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "shape", torch.masked_select: "shape", torch.bincount: "shape",
    torch.Tensor.bincount: "shape", torch.unique: "shape", torch.Tensor.unique: "shape",
}
"""Reads of tensor values; "shape": ops whose output size depends on the values (the host reads it). `numpy()` is
not one: it refuses a device tensor, so where it runs in a GPU job it reads a host tensor (`.cpu()` is counted)."""

_TORCH_DIR = str(Path(torch.__file__).parent)
_REPO = str(Path(__file__).resolve().parents[2])


def _is_mask(index: Any) -> bool:
    """An index that selects by a bool tensor (its output size is the count of True: a host read on CUDA)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


_MOVES = (torch.Tensor.to, torch.Tensor.cuda)


def _move_target(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """Where a `.to` / `.cuda` call moves its tensor: "host" (the string "cpu": a GPU job's code names the host
    so), "device" (another device, or the same one with `non_blocking` / `copy`: how the code moves a host tensor
    to the device), None (a dtype change, or a move to the device it is on: in a GPU job a host computation's
    `.to(device=other_host_tensor.device)`)."""
    if func is torch.Tensor.cuda:
        return "device"
    targets = [kwargs.get("device")] + [a for a in args[1:] if isinstance(a, (torch.device, str)) or torch.is_tensor(a)]
    targets = [t for t in targets if t is not None]
    if not targets:
        return None
    target = targets[0]
    if isinstance(target, str) and target.startswith("cpu"):
        return "host"
    device = target.device if torch.is_tensor(target) else torch.device(target)
    same = device == args[0].device
    return "device" if not same or kwargs.get("non_blocking") or kwargs.get("copy") else None


def _read_kind(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    kind = READS.get(func)
    if kind is not None:
        return kind
    if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None and not (
            args and torch.is_tensor(args[0])):
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
    them, and of what is computed from them alone (module docstring), are not counted. Count inside
    `with HostReads() as reads:`; `sites` may be swapped between steps."""

    def __init__(self, host: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.host = list(host)  # kept alive, so that their ids stay theirs
        self._host_ids = {id(t) for t in self.host}
        self._derived: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # host tensors made inside
        self.sites: collections.Counter = collections.Counter()

    def is_host(self, t: Any) -> bool:
        return torch.is_tensor(t) and (id(t) in self._host_ids or self._derived.get(id(t)) is t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        from_host = all(self.is_host(t) for t in leaves)
        target = _move_target(func, args, kwargs) if func in _MOVES else None
        kind = _read_kind(func, args, kwargs)
        if target == "device" and self.is_host(args[0]) and not kwargs.get("non_blocking", False):
            kind = "upload"  # a host tensor copied to the device: a blocking copy waits for the stream
        elif target == "host":
            kind = "cpu"  # a device tensor copied to the host (not counted below when it is a host tensor)
        if kind is not None and not (args and self.is_host(args[0]) and kind != "upload"):
            self._record(kind)
        out = func(*args, **kwargs)
        host_out = func is torch.Tensor.cpu or target == "host" or (
            target is None and (bool(leaves) or kwargs.get("device") is None) and from_host)
        if host_out:
            for t in pytree.tree_leaves(out):
                if torch.is_tensor(t) and not self.is_host(t):
                    self._derived[id(t)] = t
        return out

    def _record(self, kind: str) -> None:
        self.sites[(kind, call_site())] += 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def report(self) -> str:
        """One line per (kind, call site), most frequent first."""
        return "\n".join(f"{n:4d} {kind:7s} {site}" for (kind, site), n in self.sites.most_common())
