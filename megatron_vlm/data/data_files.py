"""Which files a `[data]` path names: one file, a folder searched recursively, or a glob.

SFT and GRPO both resolve `train_path` / `eval_path` here, so they read the same files in the
same order (sorted by their full path). The suffixes depend on `[data] type`: "hf" reads
.parquet, .arrow and .jsonl files, "messages_jsonl" reads .jsonl files. A file named directly is
taken whatever its suffix (a messages file called `train.json` has always worked).

A path that cannot be read as a whole — no data files there, a table file that does not open (a
truncated or mislabelled .parquet), a file without the columns the mapping needs — is not a bad
record to skip but a setting to fix: `FileNotFoundError` / `DataFileError` here, turned into a
`ConfigError` naming the config key (exit 2, one line) by `data_path_errors(key)` where the key is
known (the SFT and GRPO splits, the eval benchmarks). Before, they ended the job with a traceback
and exit 1.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_vlm.errors import ConfigError

__all__ = ["TABLE_SUFFIXES", "HF_SUFFIXES", "MESSAGES_SUFFIXES", "DataFileError", "data_path_errors", "find_data_files"]

TABLE_SUFFIXES = (".parquet", ".arrow")
"""Columnar files (read as tables); every other file is read as JSON lines."""
HF_SUFFIXES = (".parquet", ".arrow", ".jsonl")
MESSAGES_SUFFIXES = (".jsonl",)


def file_signature(path: Path) -> dict:
    """A file's resolved path, size and modification time: what a cache keyed on the file compares."""
    st = path.stat()
    return {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def find_data_files(path: str | os.PathLike, suffixes: tuple[str, ...] = HF_SUFFIXES) -> list[Path]:
    """The data files at `path` (see module docstring); FileNotFoundError when there are none."""
    text = os.fspath(path)
    if os.path.isdir(text):
        names = [str(p) for p in Path(text).rglob("*") if p.suffix in suffixes and p.is_file()]
    elif any(ch in text for ch in "*?["):
        names = [f for f in glob.glob(text, recursive=True) if Path(f).suffix in suffixes and os.path.isfile(f)]
    else:
        names = [text] if os.path.isfile(text) else []
    if not names:
        kinds = " / ".join(suffixes)
        raise FileNotFoundError(f"no {kinds} data files at {text!r}")
    return [Path(n) for n in sorted(names)]


class DataFileError(ValueError):
    """A data file that cannot be used as a whole (unreadable table, missing columns); the message names the file."""


@contextmanager
def data_path_errors(key: str) -> Iterator[None]:
    """Re-raise a missing or unreadable data path (FileNotFoundError, DataFileError) met inside the
    block as a ConfigError that starts with `key` (e.g. "data.train_path")."""
    try:
        yield
    except (FileNotFoundError, DataFileError) as e:
        raise ConfigError(f"{key}: {e}") from None
