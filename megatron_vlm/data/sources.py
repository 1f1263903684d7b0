"""Open the train / eval split named by a `DataConfig` as an indexable source of records.

Every source has `name`, `len()`, `get(i) -> Record` (which may raise BadRecordError) and
`locate(i) -> (file, index)`, where a bad record is counted (the 1-based line of a JSONL file, the
0-based row of a table). Sources: parsed messages JSONL (`ListRecords`), local dataset files
(`HFRecords`), or the synthetic VQA set, which is first written to `synthetic_dir` and then read
back as messages JSONL like any user data. Files are found and read by the shared reader
(`table_rows.TableRows`) that GRPO's prompt sets use as well.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Protocol

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import MESSAGES_SUFFIXES, data_path_errors, file_signature, find_data_files
from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.data.messages import Record, read_messages_jsonl
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa

__all__ = ["RecordSource", "ListRecords", "open_split"]


class RecordSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def get(self, i: int) -> Record: ...

    def locate(self, i: int) -> tuple[str, int]: ...


class ListRecords:
    """Records already in memory (parsed JSONL files); `files` are where they were read from."""

    def __init__(self, name: str, records: list[Record], files: Optional[list[Path]] = None,
                 image_root: Optional[str] = None):
        self.name = name
        self.records = records
        self.files = list(files or [])
        self.image_root = image_root
        """The root the records' relative media paths were resolved against (None: each file's folder)."""

    def __len__(self) -> int:
        return len(self.records)

    def get(self, i: int) -> Record:
        return self.records[i]

    def locate(self, i: int) -> tuple[str, int]:
        r = self.records[i]
        return r.source, r.index

    def identity(self) -> dict:
        return {"files": [file_signature(f) for f in self.files], "n": len(self.records), "image_root": self.image_root}


def _messages_source(path: str | os.PathLike, image_root: Optional[str], bad_records: Optional[BadRecordLog]) -> ListRecords:
    files = find_data_files(path, MESSAGES_SUFFIXES)
    return ListRecords(str(path), read_messages_jsonl(path, image_root=image_root, bad_records=bad_records), files,
                       image_root=str(Path(image_root).resolve()) if image_root else None)


def open_split(cfg: DataConfig, split: str, bad_records: Optional[BadRecordLog] = None) -> Optional[RecordSource]:
    """The split's records, or None when the config has no such split (an empty eval_path)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if cfg.type == "synthetic_vqa":
        if not cfg.synthetic_dir:
            raise ValueError("data.synthetic_dir: must be set for type = 'synthetic_vqa' (the trainer uses <run>/data)")
        if split == "eval" and cfg.synthetic_eval_size == 0:
            return None
        paths = write_synthetic_vqa(cfg.synthetic_dir, cfg.synthetic_train_size, cfg.synthetic_eval_size,
                                    cfg.synthetic_seed, cfg.synthetic_image_size)
        return _messages_source(str(paths[split]), None, bad_records)
    path = cfg.train_path if split == "train" else cfg.eval_path
    if not path:
        if split == "train":
            raise ValueError("data.train_path: required")
        return None
    with data_path_errors(f"data.{split}_path"):  # no files there, an unreadable table, missing columns: exit 2
        if cfg.type == "messages_jsonl":
            return _messages_source(path, cfg.image_root or None, bad_records)
        if cfg.type == "hf":
            return HFRecords(path, cfg.columns, image_root=cfg.image_root or None, bad_records=bad_records)
    raise ValueError(f"data.type: unknown source type {cfg.type!r}")
