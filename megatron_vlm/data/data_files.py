"""Which files a `[data]` path names: one file, a folder searched recursively, or a glob.

SFT and GRPO both resolve `train_path` / `eval_path` here, so they read the same files in the
same order (sorted by their full path). The suffixes depend on `[data] type`: "hf" reads
.parquet, .arrow and .jsonl files, "messages_jsonl" reads .jsonl files. A file named directly is
taken whatever its suffix (a messages file called `train.json` has always worked).
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

__all__ = ["TABLE_SUFFIXES", "HF_SUFFIXES", "MESSAGES_SUFFIXES", "find_data_files"]

TABLE_SUFFIXES = (".parquet", ".arrow")
"""Columnar files (read as tables); every other file is read as JSON lines."""
HF_SUFFIXES = (".parquet", ".arrow", ".jsonl")
MESSAGES_SUFFIXES = (".jsonl",)


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
