"""One writer per run folder: `claim_run_dir(train.output_dir)` creates the folder and takes an exclusive
lock on `<run>/.lock` for as long as the job runs.

Why: two jobs on one `train.output_dir` ruin each other: the second resumes from the first's checkpoint,
its start-up tidy deletes the first's in-flight `.tmp_step_*` (the first dies at its next commit) and
`metrics_train.csv` interleaves both. The second writer is refused at start with one line naming the key
(`ConfigError`, exit 2), before it touches anything in the folder.

The lock is a `flock` on an open file: the kernel drops it when the process ends however it ends
(kill -9 included), so a crashed job never leaves a stale lock; the pid and host in the file are only
for the message. Child processes never keep it, so a helper left behind cannot hold the folder after its job: a
started program (reward workers) does not inherit the descriptor, and a forked one (DataLoader and length-pass
workers) closes its copy at once (`os.register_at_fork`): a forked worker that outlived its rank (killed by the
OOM killer) or hung kept the folder locked, and the requeued job was refused. Where `flock` does not exist (not POSIX) the folder is not
locked, nor on a filesystem that refuses locks (a warning says so). A folder that is a file, or that cannot be created or written (read-only filesystem, permissions),
is refused the same way.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from megatron_vlm.errors import ConfigError

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["RunDirLock", "claim_run_dir", "LOCK_FILE"]

log = logging.getLogger("megatron_vlm")

LOCK_FILE = ".lock"


_held: set[int] = set()
"""The descriptors of the locks this process holds (closed in a forked child)."""


def _close_in_forked_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's copy keeps the lock
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class RunDirLock:
    """An acquired lock on a run folder; `release()` (or leaving the process) frees it."""

    def __init__(self, path: Path, fd: Optional[int]):
        self.path, self._fd = path, fd
        if fd is not None:
            _held.add(fd)

    def release(self) -> None:
        if self._fd is not None:
            _held.discard(self._fd)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_dir(run_dir: Path, key: str = "train.output_dir") -> RunDirLock:
    """Create `run_dir` (parents too) and lock it for this process; `ConfigError` naming `key` when it is a
    file, cannot be created or written, or another job holds it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{key}: {run_dir} is a file, not a folder; set {key} to a folder for the run")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(run_dir / LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"{key}: cannot use {run_dir} as the run folder ({e.strerror or e}); "
                          f"set {key} to a writable folder") from None
    if fcntl is None:
        return RunDirLock(run_dir, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no locks on this filesystem (ENOLCK, ...)
            log.warning("%s: cannot lock %s (%s); the folder is not protected against a second job", key, run_dir,
                        e.strerror or e)
            return RunDirLock(run_dir, fd)
        try:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise ConfigError(f"{key}: {run_dir} is in use by another job ({holder}); two jobs writing one run "
                          f"folder would delete each other's checkpoints: wait for it to end, or set {key} "
                          "to another folder") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError as e:  # e.g. a read-only filesystem that still let us open the file
        os.close(fd)
        raise ConfigError(f"{key}: cannot write to {run_dir} ({e.strerror or e}); set {key} to a writable folder") from None
    return RunDirLock(run_dir, fd)
