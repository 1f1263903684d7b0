"""Open the train / eval split named by a `DataConfig` as an indexable source of records.

Every source has `name`, `len()` and `get(i) -> Record` (which may raise BadRecordError): a parsed
messages JSONL (`ListRecords`), a local HF dataset (`HFRecords`), or the synthetic VQA set, which is
first written to `synthetic_dir` and then read back as messages JSONL like any user data.
"""
from __future__ import annotations

from typing import Optional, Protocol

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.messages import Record, read_messages_jsonl

__all__ = ["RecordSource", "ListRecords", "open_split"]


class RecordSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def get(self, i: int) -> Record: ...


class ListRecords:
    """Records already in memory (a parsed JSONL file)."""

    def __init__(self, name: str, records: list[Record]):
        self.name = name
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def get(self, i: int) -> Record:
        return self.records[i]


def open_split(cfg: DataConfig, split: str, bad_records: Optional[BadRecordLog] = None) -> Optional[RecordSource]:
    """The split's records, or None when the config has no such split (an empty eval_path)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if cfg.type == "synthetic_vqa":
        from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa

        if not cfg.synthetic_dir:
            raise ValueError("data.synthetic_dir: must be set for type = 'synthetic_vqa' (the trainer uses <run>/data)")
        if split == "eval" and cfg.synthetic_eval_size == 0:
            return None
        paths = write_synthetic_vqa(cfg.synthetic_dir, cfg.synthetic_train_size, cfg.synthetic_eval_size,
                                    cfg.synthetic_seed, cfg.synthetic_image_size)
        path = str(paths[split])
        return ListRecords(path, read_messages_jsonl(path, bad_records=bad_records))
    path = cfg.train_path if split == "train" else cfg.eval_path
    if not path:
        if split == "train":
            raise ValueError("data.train_path: required")
        return None
    if cfg.type == "messages_jsonl":
        return ListRecords(path, read_messages_jsonl(path, image_root=cfg.image_root or None, bad_records=bad_records))
    if cfg.type == "hf":
        from megatron_vlm.data.hf_source import HFRecords

        return HFRecords(path, cfg.columns, image_root=cfg.image_root or None)
    raise ValueError(f"data.type: unknown source type {cfg.type!r}")
