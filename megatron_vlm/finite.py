"""Finiteness checks of weights that are about to be trusted: loaded from a checkpoint, saved into one,
or exported.

Why: a few flipped bytes in a shard can turn weights into NaN or 3.4e38 without breaking the file's
format, so such a checkpoint loads "fine", the next save copies the bad tensor into a new checkpoint,
pruning deletes the last good one and the export is garbage with exit code 0. A non-finite tensor is
therefore treated as corruption when loading (the caller falls back to an older checkpoint) and
refused when saving or exporting (the previous checkpoint / export stays in place).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["NonFiniteError", "nonfinite_tensors", "check_finite"]


class NonFiniteError(ValueError):
    """Tensors hold NaN or +-inf; the message names the first few."""


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard (every rank checks its own)
    return to_local() if callable(to_local) else t


def _walk(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if torch.is_tensor(tree):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{prefix}.{i}" if prefix else str(i))


def nonfinite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Names (dotted paths in `tree`: nested dicts / lists of tensors) of the floating tensors holding a
    NaN or an infinity. Meta tensors (no data) are skipped."""
    bad = []
    for name, t in _walk(tree, prefix):
        t = _local(t)
        if t.is_floating_point() and t.device.type != "meta" and t.numel() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def check_finite(tree: Any, what: str, prefix: str = "") -> None:
    """Raise `NonFiniteError` naming `what` and the first tensors of `tree` that are not finite."""
    bad = nonfinite_tensors(tree, prefix)
    if bad:
        more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        raise NonFiniteError(f"{what}: non-finite values (NaN or inf) in {len(bad)} tensor(s): "
                             f"{', '.join(bad[:5])}{more}")
