"""Observe how a file reaches the disk: every fsync (mapped back to the path its descriptor names) and every rename,
in order, and check a file was written durably (a temporary sibling fsynced, renamed over the final name, the folder
fsynced after). Maps descriptors to paths through /proc/self/fd (Linux)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

needs_proc_fd = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")


def record_io(monkeypatch) -> list[tuple[str, str, str]]:
    """Record every fsync (with the path its descriptor names) and every rename, in order."""
    events: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}"), ""))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def assert_durable(events, final: Path) -> None:
    final, folder = os.path.realpath(final), os.path.realpath(final.parent)
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == final]
    assert len(renames) == 1, f"{final} is not put in place by one rename: {events}"
    i = renames[0]
    tmp = events[i][1]
    assert tmp != final and os.path.dirname(tmp) == folder  # a sibling: the rename is atomic
    assert ("fsync", tmp, "") in events[:i], f"the temporary file is not fsynced before its rename: {events}"
    assert ("fsync", folder, "") in events[i + 1:], f"the folder is not fsynced after the rename: {events}"
