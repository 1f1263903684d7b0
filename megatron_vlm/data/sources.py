"""Open the train / eval split named by a `DataConfig` as an indexable source of records.

Every source has `name`, `len()`, `get(i) -> Record` (which may raise BadRecordError) and
`locate(i) -> (file, index)`, where a bad record is counted (the 1-based line of a JSONL file, the
0-based row of a table). Sources: messages JSONL (`MessagesRecords`, a record built per `get`;
`ListRecords` for records already in memory), local dataset files
(`HFRecords`), or the synthetic VQA set, which is first written to `synthetic_dir` and then read
back as messages JSONL like any user data. Files are found and read by the shared reader
(`table_rows.TableRows`) that GRPO's prompt sets use as well.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from megatron_vlm.data.bad_records import BadRecordLog, unexpected
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import MESSAGES_RECORD_KEYS, MESSAGES_SUFFIXES, data_path_errors, file_signature
from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.data.messages import Record, record_from_messages_row, resolve_path
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.data.table_rows import TableRows

__all__ = ["RecordSource", "ListRecords", "MessagesRecords", "open_split"]


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


class MessagesRecords:
    """A messages-JSONL split read through `TableRows`, one `Record` built per `get` (as `ListRecords` over
    `read_messages_jsonl` would hold them all, in the same order, with the same bad records at open).

    Every row is converted once when the split is opened, so a row that is not a valid record is found,
    counted and left out then (its neighbours keep their indices, as before); only the row indices of the
    good ones are kept (int64), not a million `Record`s of Python objects per rank."""

    def __init__(self, path: str | os.PathLike, image_root: Optional[str], bad_records: Optional[BadRecordLog]):
        self.name = str(path)
        self.rows = TableRows(path, suffixes=MESSAGES_SUFFIXES, bad_records=bad_records, record_keys=MESSAGES_RECORD_KEYS)
        self.files = list(self.rows.files)
        self._root = Path(image_root) if image_root else None
        self._folders: dict[str, Path] = {}
        self.image_root = str(self._root.resolve()) if self._root else None
        """The root the records' relative media paths are resolved against (None: each file's folder)."""
        keep = []
        for i in range(len(self.rows)):
            try:
                self._record(i)
            except Exception as e:  # every per-record failure is a counted bad record (unexpected ones by type)
                if bad_records is not None:
                    source, lineno = self.rows.locate(i)
                    bad_records.add_error(source, lineno, unexpected(e, f"{source}:{lineno}"))
                continue
            keep.append(i)
        self._rows = np.asarray(keep, dtype=np.int64)

    def _record(self, i: int) -> Record:
        source, lineno = self.rows.locate(i)
        root = self._root or self._folders.get(source)
        if root is None:  # each file's folder, resolved once (a realpath per record costs as much as parsing it)
            root = self._folders[source] = Path(source).resolve().parent
        return record_from_messages_row(self.rows.row(i), lambda ref: resolve_path(ref, root), source=source,
                                        index=lineno)

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, i: int) -> Record:
        return self._record(int(self._rows[i]))

    def locate(self, i: int) -> tuple[str, int]:
        return self.rows.locate(int(self._rows[i]))

    def identity(self) -> dict:
        return {"files": [file_signature(f) for f in self.files], "n": len(self), "image_root": self.image_root}


def _messages_source(path: str | os.PathLike, image_root: Optional[str],
                     bad_records: Optional[BadRecordLog]) -> MessagesRecords:
    return MessagesRecords(path, image_root, bad_records)


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
