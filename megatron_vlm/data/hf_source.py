"""Hugging Face `datasets` tables from local files as a source of message records.

`HFRecords(path, columns)` opens local parquet / arrow / jsonl files (one file, a folder of them,
a glob, or a folder written by `Dataset.save_to_disk`) — nothing is downloaded — and builds a
`Record` per row on demand, through the column mapping of the `[data] columns` table:

- conversation datasets: {"messages": col} with optional {"images": col}; image items without a
  path in the messages (e.g. llava-instruct-mix: {"type": "image"}) take the row's images in order;
- prompt / answer datasets (Geometry3K, ViRL39K style): {"prompt": col, "answer": col} with
  optional "image" / "images" (one or a list), "video" (frame list or path) and "system" columns;
  the user turn is [images..., video, prompt text]; "<image>" markers in the prompt are removed
  because the images are placed before the text.

Image columns are read without decoding (`Image(decode=False)`: bytes or path), so planning packs
reads only image headers. Rows whose structure is wrong raise BadRecordError naming the column.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.messages import Record, normalize_messages, resolve_path

__all__ = ["HFRecords", "load_local_dataset"]

_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


def _data_files(path: str) -> list[str]:
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*") if p.suffix in _BUILDERS)
    else:
        files = [path]
    if not files:
        raise FileNotFoundError(f"no data files (.parquet / .arrow / .jsonl) at {path}")
    return files


def load_local_dataset(path: str | os.PathLike, *, cache_dir: Optional[str] = None):
    """A `datasets.Dataset` from local files only (see module docstring)."""
    import datasets

    path = str(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json")):
        return datasets.load_from_disk(path)
    files = _data_files(path)
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data file not found: {f}")
    kinds = {_BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"{path}: expected files of one kind among {sorted(_BUILDERS)}, got "
                         f"{sorted({Path(f).suffix for f in files})}")
    kind = kinds.pop()
    if kind == "arrow" and len(files) == 1:
        return datasets.Dataset.from_file(files[0])
    return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)


def _no_decode(feature: Any) -> Any:
    """The same feature type with every Image(decode=True) turned into Image(decode=False)."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, dict):
        return {k: _no_decode(v) for k, v in feature.items()}
    if hasattr(feature, "feature") and isinstance(feature, datasets.List):
        return datasets.List(_no_decode(feature.feature), length=getattr(feature, "length", -1))
    return feature


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class HFRecords:
    """Rows of a local HF dataset as `Record`s; `get(i)` raises BadRecordError for a bad row."""

    def __init__(self, path: str | os.PathLike, columns: dict[str, str], *, image_root: str | None = None,
                 cache_dir: Optional[str] = None):
        self.name = str(path)
        self.columns = dict(columns)
        ds = load_local_dataset(path, cache_dir=cache_dir)
        missing = sorted(c for c in self.columns.values() if c not in ds.column_names)
        if missing:
            raise ValueError(f"{path}: columns {missing} not in the dataset (has {ds.column_names})")
        if "messages" not in self.columns and not {"prompt", "answer"} <= set(self.columns):
            raise ValueError(f"{path}: columns needs 'messages' or both 'prompt' and 'answer', got {sorted(self.columns)}")
        features = ds.features.copy()
        changed = False
        for col in ds.column_names:
            nf = _no_decode(features[col])
            if repr(nf) != repr(features[col]):
                features[col], changed = nf, True
        self.dataset = ds.cast(features) if changed else ds
        p = Path(path)
        default_root = p if p.is_dir() else p.parent
        self.root = Path(image_root) if image_root else default_root.resolve()
        mapped = set(self.columns.values())
        self._meta_columns = [c for c in self.dataset.column_names if c not in mapped]

    def __len__(self) -> int:
        return len(self.dataset)

    def _resolve(self, ref: Any) -> Any:
        if isinstance(ref, dict) and "bytes" in ref:
            if ref.get("bytes"):
                return {"bytes": ref["bytes"], "path": ref.get("path")}
            return resolve_path(ref.get("path"), self.root)
        return resolve_path(ref, self.root)

    def get(self, i: int) -> Record:
        row = self.dataset[int(i)]
        c = self.columns
        if "messages" in c:
            raw = row[c["messages"]]
            if isinstance(raw, str):
                try:
                    raw = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise BadRecordError("malformed_json", f"column {c['messages']!r}: {e}") from None
            messages = normalize_messages(raw, self._resolve)
            images = [self._resolve(x) for x in _as_list(row[c["images"]])] if "images" in c else []
            empty = [it for m in messages if not isinstance(m["content"], str)
                     for it in m["content"] if it["type"] == "image" and it["image"] is None]
            if empty:
                if len(empty) != len(images):
                    raise BadRecordError("placeholder_mismatch", f"{len(empty)} image items in column "
                                         f"{c['messages']!r} but {len(images)} images in column {c.get('images')!r}")
                for it, ref in zip(empty, images):
                    it["image"] = ref
        else:
            prompt = row[c["prompt"]]
            answer = row[c["answer"]]
            if not isinstance(prompt, str):
                raise BadRecordError("invalid_record", f"column {c['prompt']!r}: expected text, got {type(prompt).__name__}")
            if answer is None:
                raise BadRecordError("invalid_record", f"column {c['answer']!r} is empty")
            items: list[dict] = []
            for key in ("image", "images"):
                if key in c:
                    items += [{"type": "image", "image": self._resolve(x)} for x in _as_list(row[c[key]])]
            if "video" in c and row[c["video"]] is not None:
                v = row[c["video"]]
                items.append({"type": "video", "video": [self._resolve(x) for x in v] if isinstance(v, (list, tuple))
                              else self._resolve(v)})
            items.append({"type": "text", "text": prompt.replace("<image>", "").strip()})
            raw = ([{"role": "system", "content": row[c["system"]]}] if "system" in c and row[c["system"]] else [])
            raw += [{"role": "user", "content": items}, {"role": "assistant", "content": str(answer)}]
            messages = normalize_messages(raw)
        meta = {k: row[k] for k in self._meta_columns if isinstance(row[k], (str, int, float, bool))}
        if "answer" in c:
            meta.setdefault("answer", str(row[c["answer"]]))
        for m in messages:
            if not isinstance(m["content"], str):
                for it in m["content"]:
                    if it["type"] in ("image", "video") and it[it["type"]] is None:
                        raise BadRecordError("invalid_record", f"an {it['type']} item has no data")
        return Record(messages, self.name, int(i), meta)
