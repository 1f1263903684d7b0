"""`[data] type = "hf"` for SFT: the rows of local parquet / arrow / jsonl files as message records.

`HFRecords(path, columns)` reads the files through the shared reader (`table_rows.TableRows`: a
file, a folder searched recursively or a glob; nothing is downloaded) and builds a `Record` per
row on demand, through the column mapping of the `[data] columns` table:

- conversation datasets: {"messages": col} with optional {"images": col}; image items without a
  path in the messages (e.g. llava-instruct-mix: {"type": "image"}) take the row's images in order,
  one each ("placeholder_mismatch" otherwise, also for images no item takes, e.g. a LLaVA-style
  "<image>" marker in the text instead of an image item);
- LLaVA / ShareGPT conversation datasets (a column of {"from", "value"} turns, e.g. LLaVA-OneVision's
  "conversations"): the same {"messages": col} mapping; the row's "image" / "images" columns go where the
  turns' "<image>" markers are, its "video" column (one video: a file, or a list of frames) where the "<video>"
  marker is (LLaVA-Video-178K writes it as "<image>" in a row with a video and no image: read as the messages_jsonl
  source reads it), and an optional "system" column becomes the system turn (conversations.py); a role / content
  messages column takes the "video" column at its "<video>" text marker or its video item without data, as images;
- TRL's conversational prompt-completion datasets: the same {"prompt": col, "answer": col} mapping where the prompt
  cell is a list of messages (no assistant turn: SFT trains every assistant turn, TRL only the completion) and the
  answer cell a string or one assistant message; the conversation is the prompt's turns then the completion, with
  the "image" / "images" and "system" columns placed as for a messages column;
- prompt / answer datasets (Geometry3K, ViRL39K style): {"prompt": col, "answer": col} with
  optional "image" / "images" (one or a list), "video" (frame list or path) and "system" columns;
  the media go where the prompt's "<image>" / "<video>" markers are (as GRPO's reader places a row's images:
  the same row is one prompt in both), before the text in a prompt without markers (the user turn is then
  [images..., video, prompt text]). A prompt with markers must have as many as it
  has images (videos) (else "placeholder_mismatch", as GRPO's prompt reader decides: a question about two
  images given one must not train); a prompt without markers takes any number. The answer is a
  string or a number / bool (its text); a list or struct cell is an "invalid_record".

Image columns are taken as stored (an Image feature's {bytes, path} struct, or a path), so planning
packs reads only image headers. Relative paths resolve against `image_root`, else the folder of the
row's file. A record's `source` / `index` are its file and row (`TableRows.locate`); rows whose
structure is wrong raise BadRecordError naming the column.

The other columns become the record's metadata when they hold a scalar; a "tools" column (the tool specs the
chat template renders, `Record.tools`) is kept also as a list, as the messages_jsonl source keeps its top-level
"tools" (a table's list of structs without the None fields Arrow adds for the keys other rows' specs have).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.conversations import (
    is_conversation_turns,
    marked_text_messages,
    messages_from_conversations,
    place_marked_media,
    refuse_markers_beside_items,
)
from megatron_vlm.data.data_files import HF_SUFFIXES, TABLE_SUFFIXES, DataFileError, record_columns
from megatron_vlm.data.messages import Record, normalize_messages, normalize_tools, resolve_path
from megatron_vlm.data.prompt_completion import answer_text, completion_turns, prompt_turns
from megatron_vlm.data.table_rows import TableRows

__all__ = ["HFRecords", "TableRecordSource", "record_from_columns", "check_columns", "check_file_columns",
           "check_media_items", "fill_image_items"]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _without_nulls(value: Any) -> Any:
    """`value` with the None-valued keys of its dicts dropped, at any depth: an Arrow list of structs holds every
    field that any row's specs have, None where a spec has none (a JSON null in a table is not told apart)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_nulls(v) for v in value]
    return value


def _resolver(root: Path):
    def resolve(ref: Any) -> Any:
        if isinstance(ref, dict) and "bytes" in ref:
            if ref.get("bytes"):
                return {"bytes": ref["bytes"], "path": ref.get("path")}
            return resolve_path(ref.get("path"), root)
        return resolve_path(ref, root)
    return resolve


def check_media_items(messages: list[dict]) -> None:
    """BadRecordError "invalid_record" for an image / video item of normalised `messages` that has no data."""
    for m in messages:
        if not isinstance(m["content"], str):
            for it in m["content"]:
                if it["type"] in ("image", "video") and it[it["type"]] is None:
                    raise BadRecordError("invalid_record", f"an {it['type']} item has no data")


def fill_image_items(empty: list[dict], images: list, where: str, column: Any) -> None:
    """Give the image items without data (`empty`, found in `where`) the row's `images` (from `column`) in
    order; BadRecordError "placeholder_mismatch" unless there are as many of each (SFT records and preference
    prompts place a row's images the same way)."""
    if len(empty) != len(images):
        raise BadRecordError("placeholder_mismatch", f"{len(empty)} image items in {where} but {len(images)} "
                                                     f"images in column {column!r}")
    for it, ref in zip(empty, images):
        it["image"] = ref


def check_columns(rows: TableRows, columns: dict[str, str]) -> None:
    """ValueError unless the mapping is usable and DataFileError unless every file (with rows) has the mapped columns."""
    if "messages" not in columns and not {"prompt", "answer"} <= set(columns):
        raise ValueError(f"{rows.name}: columns needs 'messages' or both 'prompt' and 'answer', got {sorted(columns)}")
    check_file_columns(rows, columns)


def check_file_columns(rows: TableRows, columns: dict[str, str]) -> None:
    """DataFileError unless every file (with rows) has the columns the mapping names."""
    for file in rows.files:
        have = rows.columns(file)
        missing = sorted(c for c in columns.values() if c not in have)
        if have and missing:
            raise DataFileError(f"{file}: columns {missing} not in the dataset (has {have})")


def record_from_columns(row: dict, columns: dict[str, str], *, root: Path, source: str, index: int) -> Record:
    """The `Record` of one row under a `[data] columns` mapping (see module docstring)."""
    c = columns
    resolve = _resolver(root)
    if "messages" in c:
        raw = row.get(c["messages"])
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise BadRecordError("malformed_json", f"column {c['messages']!r}: {e}") from None
            except RecursionError:
                raise BadRecordError("malformed_json", f"column {c['messages']!r}: nested too deeply for the JSON "
                                                       "parser") from None
        if is_conversation_turns(raw):  # LLaVA / ShareGPT turns: the media go where their markers are
            refs = [x for key in ("image", "images") if key in c for x in _as_list(row.get(c[key]))]
            raw = messages_from_conversations(raw, system=row.get(c["system"]) if "system" in c else None,
                                              images=refs, videos=_row_video(row, c), key=f"column {c['messages']!r}")
            messages = normalize_messages(raw, resolve)
        else:
            messages = _role_messages(raw, row, c, resolve, f"column {c['messages']!r}")
    elif isinstance(row.get(c["prompt"]), (list, tuple)):  # TRL's conversational prompt-completion
        if "video" in c and row.get(c["video"]) is not None:
            raise BadRecordError("invalid_record", f"column {c['video']!r}: a video beside a conversational prompt "
                                                   f"(column {c['prompt']!r}) is not read; write video items in it")
        raw = prompt_turns(row[c["prompt"]], c["prompt"]) + completion_turns(row.get(c["answer"]), c["answer"])
        messages = _role_messages(raw, row, c, resolve, f"column {c['prompt']!r}")
    else:
        prompt = row.get(c["prompt"])
        answer = row.get(c["answer"])
        if not isinstance(prompt, str):
            raise BadRecordError("invalid_record", f"column {c['prompt']!r}: expected text, got {type(prompt).__name__}")
        answer = answer_text(answer, c["answer"])
        items: list[dict] = []
        for key in ("image", "images"):
            if key in c:
                items += [{"type": "image", "image": resolve(x)} for x in _as_list(row.get(c[key]))]
        video = row.get(c["video"]) if "video" in c else None
        if video is not None:
            items.append({"type": "video", "video": [resolve(x) for x in video] if isinstance(video, (list, tuple))
                          else resolve(video)})
        for kind in ("image", "video"):  # the rule of GRPO's reader (rl/prompts/dataset.py): the same rows usable in both
            markers, given = prompt.count(f"<{kind}>"), sum(it["type"] == kind for it in items)
            if markers and markers != given:
                raise BadRecordError("placeholder_mismatch", f"column {c['prompt']!r}: {markers} <{kind}> placeholders "
                                                             f"but {given} {kind}s")
        items = _at_markers(prompt, items)
        system = row.get(c["system"]) if "system" in c else None
        raw = [{"role": "system", "content": system}] if system else []
        raw += [{"role": "user", "content": items}, {"role": "assistant", "content": answer}]
        messages = normalize_messages(raw)
    mapped = set(c.values())
    meta: dict[str, Any] = {k: v for k, v in row.items() if k not in mapped and isinstance(v, (str, int, float, bool))}
    tools = row.get("tools") if "tools" not in mapped else None
    if isinstance(tools, (list, tuple)):  # the tool specs as a list column (a JSON-string column is a scalar above)
        meta["tools"] = _without_nulls(tools) if Path(source).suffix in TABLE_SUFFIXES else tools
    normalize_tools(meta.get("tools"))  # a malformed spec is this row's error (as in messages_jsonl)
    if "answer" in c:
        meta.setdefault("answer", messages[-1]["content"])
    check_media_items(messages)
    return Record(messages, source, index, meta)


def _row_video(row: dict, c: dict[str, str]) -> list:
    """The row's video under the "video" mapping, as a list of videos: [] without one, else [the cell] (a file, or a
    list of frames: one video, as a record's "video" key reads, `conversations.media_list`)."""
    value = row.get(c["video"]) if "video" in c else None
    return [] if value is None else [list(value) if isinstance(value, tuple) else value]


def _role_messages(raw: Any, row: dict, c: dict[str, str], resolve, where: str) -> list[dict]:
    """Normalised role / content `raw` messages with the row's "system" column as their first turn (unless they have
    one) and its "image" / "images" columns ("video" column) at their "<image>" ("<video>") text markers (ms-swift) or
    in their image (video) items without data (TRL), in order; BadRecordError when media and their places are not as
    many."""
    system = row.get(c["system"]) if "system" in c else None
    if system and isinstance(raw, list) and not any(isinstance(m, dict) and m.get("role") == "system" for m in raw):
        raw = [{"role": "system", "content": system}, *raw]  # a row's own system turn wins
    image_keys = [key for key in ("image", "images") if key in c]
    refs = [x for key in image_keys for x in _as_list(row.get(c[key]))]
    videos = _row_video(row, c)
    if (refs or videos) and isinstance(raw, list) and marked_text_messages(raw):  # ms-swift's layout: the media go
        raw, refs, videos = place_marked_media(raw, images=refs, videos=videos, key=where), [], []  # at the markers
    messages = normalize_messages(raw, resolve)
    images = [resolve(x) for x in refs]
    empty = [it for m in messages if not isinstance(m["content"], str)
             for it in m["content"] if it["type"] == "image" and it["image"] is None]
    if images:
        refuse_markers_beside_items(messages, "image", where)
    if empty or images:  # images that no item takes (e.g. "<image>" text markers) would train without them
        fill_image_items(empty, images, where, " + ".join(c[k] for k in image_keys) or None)
    empty = [it for m in messages if not isinstance(m["content"], str)
             for it in m["content"] if it["type"] == "video" and it["video"] is None]
    if videos:
        refuse_markers_beside_items(messages, "video", where)
    if empty or videos:  # a video that no item takes would train without it
        if len(empty) != len(videos):
            raise BadRecordError("placeholder_mismatch", f"{len(empty)} video items in {where} but {len(videos)} "
                                                         f"videos in column {c.get('video')!r}")
        for it, ref in zip(empty, videos):
            it["video"] = [resolve(x) for x in ref] if isinstance(ref, list) else resolve(ref)
    return messages


class TableRecordSource:
    """Rows of local dataset files under a column mapping: the reading, locating and identity that the SFT
    records here and the preference pairs (data/preference_records.py) share; a subclass's `get` turns
    the row that `_row` gives into its record."""

    def __init__(self, path: str | os.PathLike, columns: dict[str, str], *, suffixes: tuple[str, ...],
                 image_root: Optional[str] = None, cache_dir: Optional[str] = None,
                 bad_records: Optional[BadRecordLog] = None):
        self.name = str(path)
        self.columns = dict(columns)
        self.rows = TableRows(path, suffixes=suffixes, bad_records=bad_records, cache_dir=cache_dir,
                              record_keys=record_columns(self.columns))
        self.image_root = Path(image_root) if image_root else None

    def __len__(self) -> int:
        return len(self.rows)

    def locate(self, i: int) -> tuple[str, int]:
        return self.rows.locate(i)

    def identity(self) -> dict:
        return {"files": self.rows.identity(), "columns": self.columns,
                "image_root": str(self.image_root.resolve()) if self.image_root else None}

    def _row(self, i: int) -> tuple[dict, Path, str, int]:
        """(row i, the folder its relative image paths resolve against, its file, its row in that file)."""
        source, index = self.rows.locate(i)
        root = self.image_root or Path(source).resolve().parent
        return self.rows.row(i), root, source, index


class HFRecords(TableRecordSource):
    """Rows of local dataset files as `Record`s; `get(i)` raises BadRecordError for a bad row.

    Malformed JSON lines are not rows: they go to `bad_records` when the files are opened."""

    def __init__(self, path: str | os.PathLike, columns: dict[str, str], *, image_root: str | None = None,
                 cache_dir: Optional[str] = None, bad_records: Optional[BadRecordLog] = None):
        super().__init__(path, columns, suffixes=HF_SUFFIXES, image_root=image_root, cache_dir=cache_dir,
                         bad_records=bad_records)
        check_columns(self.rows, self.columns)

    def get(self, i: int) -> Record:
        row, root, source, index = self._row(i)
        return record_from_columns(row, self.columns, root=root, source=source, index=index)


_MARKER = re.compile(r"(<image>|<video>)")


def _at_markers(prompt: str, media: list[dict]) -> list[dict]:
    """The user turn of a prompt / answer row: `media` (images, then the video) where the prompt's "<image>" /
    "<video>" markers are, in order, the text pieces between them stripped (as GRPO's reader places a row's images,
    rl/prompts/dataset.py, so the same row is one prompt in both); a prompt without markers has its media before
    the text. The marker counts were checked against the media given."""
    if not _MARKER.search(prompt):
        return [*media, {"type": "text", "text": prompt.strip()}]
    queues = {kind: [it for it in media if it["type"] == kind] for kind in ("image", "video")}
    unmarked = {kind for kind in queues if f"<{kind}>" not in prompt}
    out = [it for it in media if it["type"] in unmarked]  # e.g. images given with only a <video> marker: first
    for piece in _MARKER.split(prompt):
        if piece in ("<image>", "<video>"):
            out.append(queues[piece[1:-1]].pop(0))
        elif piece.strip():
            out.append({"type": "text", "text": piece.strip()})
    return out
