"""Files that survive a crash of the host: written under a temporary name, fsynced, renamed, the folder fsynced.

A file that a later start reads back (a checkpoint marker, the DPO reference table, the length cache, an
evaluation's kept results, the bad-record summary, the metrics file cut back at a resume) must never be found cut
short, empty, or with its old content after the new one was reported written. `os.replace` alone is atomic for
processes that keep running, not for a host that dies: until an fsync the page cache may hold the data, and until
the folder is fsynced the new name itself. Every such writer in the package goes through `write_file_durably`.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["fsync_dir", "fsync_file", "fsync_tree", "write_file_durably", "write_text_durably"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder, so the names created / renamed in it are on disk."""
    fsync_file(path)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync the file (or folder) `path` through a read-only descriptor."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under `root`, then every folder bottom-up (`root` last)."""
    for dirpath, _, filenames in os.walk(str(root), topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


def write_file_durably(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Write the file `path` atomically and durably: `write(f)` fills a temporary sibling, which is fsynced, renamed
    over `path`, and the folder fsynced.

    Until the rename the final name keeps its previous content (or stays absent). The temporary name carries the
    process id, so two processes writing the same file (two jobs sharing a cache folder) never write into one
    temporary file; the last rename wins with a whole file. A failure while writing (a full disk, an exception in
    `write`) removes the temporary file and re-raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_durably(path: str | os.PathLike, text: str) -> None:
    """`write_file_durably` of a text (UTF-8)."""
    write_file_durably(path, lambda f: f.write(text.encode("utf-8")))
