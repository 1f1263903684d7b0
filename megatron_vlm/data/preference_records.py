"""Preference pairs (a prompt with its images, a chosen and a rejected response) and their sources.

Rows come from the shared reader (`table_rows.TableRows`): JSON lines for `[data] type = "messages_jsonl"`,
parquet / arrow / JSON lines through the `[data] columns` mapping for `type = "hf"`. The layouts are
TRL's preference formats:

- standard: {"prompt": "What is ...?", "chosen": "...", "rejected": "..."} (+ "images": [...] or "image":
  one; "<image>" markers in the prompt are removed, the images go before the text, as the SFT reader does);
- conversational: "prompt" a messages list (the SFT messages format: image items with a path,
  `{"type": "image"}` filled from the images column in order, or text turns whose "<image>" markers take
  them in place), "chosen" / "rejected" a one-message
  assistant list ([{"role": "assistant", "content": ...}]) or a string;
- implicit prompt: no prompt column; "chosen" / "rejected" are whole conversations that differ only in
  their last (assistant) turn, which is the response.

In JSON lines the prompt may also be called "messages" (`{"messages": [...prompt turns...], "chosen": ...}`),
and "system" adds a system turn to the prompt (a messages prompt with a system turn of its own keeps that one, as
the SFT reader does). A row whose structure is wrong, or whose chosen and rejected
responses are the same text (nothing to prefer), is a bad record (`BadRecordError`, counted, the pair skipped).

`SyntheticPreferencePairs` builds pairs from the synthetic VQA set (data/synthetic_vqa.py): the
question with its image, chosen = the right answer, rejected = a wrong one drawn from the whole answer
vocabulary of the task (so of the same question type or not), a pure function of (seed, record index).

`ResponseHalves` shows a pair source as 2 x N SFT records (2i = prompt + chosen, 2i + 1 = prompt +
rejected): lengths, processing and bad-record counting then reuse the SFT machinery unchanged.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.conversations import marked_text_messages, place_marked_media, refuse_markers_beside_items
from megatron_vlm.data.data_files import HF_SUFFIXES, MESSAGES_SUFFIXES
from megatron_vlm.data.hf_source import (
    TableRecordSource,
    _as_list,
    _resolver,
    check_file_columns,
    check_media_items,
    fill_image_items,
)
from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.synthetic_vqa import ANSWERS

__all__ = ["PreferenceRecord", "preference_from_row", "PreferenceRows", "SyntheticPreferencePairs", "ResponseHalves",
           "JSONL_COLUMNS"]

JSONL_COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "images": "images", "image": "image",
                 "system": "system"}
"""The column names of a preference JSON-lines row (a prompt may also be called "messages")."""


@dataclass
class PreferenceRecord:
    prompt: list[dict]
    """The conversation before the response (raw messages; normalised when the halves are built)."""
    chosen: str
    rejected: str
    source: str
    index: int
    meta: dict = field(default_factory=dict)

    def halves(self) -> tuple[Record, Record]:
        """(prompt + chosen, prompt + rejected) as SFT records; BadRecordError for a malformed prompt."""
        out = []
        for text in (self.chosen, self.rejected):
            messages = normalize_messages([*self.prompt, {"role": "assistant", "content": text}])
            check_media_items(messages)
            out.append(Record(messages, self.source, self.index, dict(self.meta)))
        return out[0], out[1]


def _maybe_json(value: Any, name: str) -> Any:
    """A cell that is a JSON-encoded list of message objects (as a table may store one) as that list; any other string
    as it is: a text may start with "[" ("[1] ...", a markdown link, "[2, 3]"). A string that opens such a list ("[{")
    but does not parse is malformed_json, not text."""
    if not isinstance(value, str) or value[:1] != "[":
        return value
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        if value[1:].lstrip().startswith("{"):
            raise BadRecordError("malformed_json", f"column {name!r}: {e}") from None
        return value
    if isinstance(parsed, list) and parsed and all(isinstance(m, dict) for m in parsed):
        return parsed
    return value


def _text_of(content: Any, name: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(isinstance(it, dict) and isinstance(it.get("text"), str)
                                                  for it in content):
        return "".join(it["text"] for it in content)
    raise BadRecordError("invalid_record", f"column {name!r}: the response must be text")


def _response(value: Any, name: str) -> str:
    """A response column: a string or a one-message assistant list."""
    value = _maybe_json(value, name)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], dict) \
            and value[0].get("role", "assistant") == "assistant":
        return _text_of(value[0].get("content"), name)
    raise BadRecordError("invalid_record", f"column {name!r}: expected a string or one assistant message, got "
                                           f"{type(value).__name__}{' of ' + str(len(value)) if isinstance(value, list) else ''}")


def _split_conversation(value: Any, name: str) -> tuple[list[dict], str]:
    """(prompt turns, response) of a whole conversation whose last turn is the assistant's response."""
    value = _maybe_json(value, name)
    if not isinstance(value, (list, tuple)) or len(value) < 2 or not isinstance(value[-1], dict) \
            or value[-1].get("role") != "assistant":
        raise BadRecordError("invalid_record", f"column {name!r}: without a prompt column the response must be a "
                                               "conversation ending with an assistant turn")
    return list(value[:-1]), _text_of(value[-1].get("content"), name)


def _fill_images(prompt: list[dict], images: list, name: str) -> list[dict]:
    """Image items without data take the row's images in order, or "<image>" markers of text-only turns take them at
    their places (ms-swift's layout, as the SFT reader places them)."""
    if images and marked_text_messages(prompt):
        return place_marked_media(prompt, images=images, key=name)
    if images:
        refuse_markers_beside_items(prompt, "image", "the prompt")
    prompt = [dict(m) for m in prompt]
    empty = []
    for m in prompt:
        if isinstance(m.get("content"), (list, tuple)):
            m["content"] = [dict(it) if isinstance(it, dict) else it for it in m["content"]]
            empty += [it for it in m["content"] if isinstance(it, dict) and it.get("type") == "image"
                      and it.get("image") is None and it.get("image_url") is None and it.get("path") is None]
    if empty:
        fill_image_items(empty, images, "the prompt", name)
    elif images:
        raise BadRecordError("placeholder_mismatch", f"{len(images)} images in column {name!r} but the prompt "
                                                     "messages have no image item to place them")
    return prompt


def _string_prompt(prompt: str, images: list, system: Any) -> list[dict]:
    markers = prompt.count("<image>")
    if markers and markers != len(images):
        raise BadRecordError("placeholder_mismatch", f"{markers} <image> placeholders but {len(images)} images")
    items = [{"type": "image", "image": ref} for ref in images]
    items.append({"type": "text", "text": prompt.replace("<image>", "").strip()})
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return head + [{"role": "user", "content": items}]


def _with_system(prompt: list[dict], system: Any) -> list[dict]:
    """A messages prompt with the row's "system" column as its first turn, unless the prompt has a system turn of its
    own (that one wins, as in the SFT reader's messages rows); a string prompt gets it in `_string_prompt`."""
    if not isinstance(system, str) or not system:
        return prompt
    if any(isinstance(m, dict) and m.get("role") == "system" for m in prompt):
        return prompt
    return [{"role": "system", "content": system}, *prompt]


def preference_from_row(row: dict, columns: dict[str, str], *, resolve, source: str, index: int) -> PreferenceRecord:
    """The pair of one row under a column mapping (module docstring); raises BadRecordError."""
    c = columns
    for key in ("chosen", "rejected"):
        if row.get(c[key]) is None:
            raise BadRecordError("invalid_record", f"column {c[key]!r} is missing or empty")
    images = [resolve(x) for key in ("image", "images") if key in c for x in _as_list(row.get(c[key]))]
    prompt_col = c.get("prompt")
    raw_prompt = row.get(prompt_col) if prompt_col else None
    if prompt_col and raw_prompt is None and "messages" in row and prompt_col == JSONL_COLUMNS["prompt"]:
        prompt_col, raw_prompt = "messages", row["messages"]
    if raw_prompt is None:
        prompt, chosen = _split_conversation(row[c["chosen"]], c["chosen"])
        prompt_r, rejected = _split_conversation(row[c["rejected"]], c["rejected"])
        if prompt_r != prompt:
            raise BadRecordError("invalid_record", f"columns {c['chosen']!r} / {c['rejected']!r}: the conversations "
                                                   "differ before their last turn (no common prompt)")
        prompt = _fill_images(prompt, images, c.get("images", c.get("image", "images")))
    else:
        chosen, rejected = _response(row[c["chosen"]], c["chosen"]), _response(row[c["rejected"]], c["rejected"])
        raw_prompt = _maybe_json(raw_prompt, prompt_col)
        if isinstance(raw_prompt, str):
            prompt = _string_prompt(raw_prompt, images, row.get(c["system"]) if "system" in c else None)
        elif isinstance(raw_prompt, (list, tuple)) and raw_prompt:
            prompt = _fill_images(list(raw_prompt), images, c.get("images", c.get("image", "images")))
        else:
            raise BadRecordError("invalid_record", f"column {prompt_col!r}: expected text or a messages list")
    if not prompt or not isinstance(prompt[-1], dict) or prompt[-1].get("role") != "user":
        raise BadRecordError("invalid_record", "the prompt must end with a user turn")
    if not isinstance(raw_prompt, str):
        prompt = _with_system(prompt, row.get(c["system"]) if "system" in c else None)
    if chosen == rejected:  # no preference to learn: zero gradient, but it would count in the step's mean and metrics
        raise BadRecordError("invalid_record", f"columns {c['chosen']!r} / {c['rejected']!r}: the chosen and rejected "
                                               "responses are identical")
    mapped = set(c.values()) | {"messages"}
    meta = {k: v for k, v in row.items() if k not in mapped and isinstance(v, (str, int, float, bool))}
    prompt = normalize_messages([*prompt, {"role": "assistant", "content": chosen}], resolve)[:-1]  # paths resolved
    rec = PreferenceRecord(prompt, chosen, rejected, source, index, meta)
    rec.halves()  # structure errors surface here, as a bad record of this row
    return rec


class PreferenceRows(TableRecordSource):
    """Preference pairs of local files (`[data] type = "messages_jsonl"` or "hf"); `get(i)` may raise BadRecordError."""

    def __init__(self, path: str, columns: Optional[dict[str, str]] = None, *, jsonl: bool, image_root: Optional[str] = None,
                 bad_records: Optional[BadRecordLog] = None):
        super().__init__(path, columns if columns else JSONL_COLUMNS, suffixes=MESSAGES_SUFFIXES if jsonl else HF_SUFFIXES,
                         image_root=image_root, bad_records=bad_records)
        if not jsonl:
            check_file_columns(self.rows, self.columns)

    def get(self, i: int) -> PreferenceRecord:
        row, root, source, index = self._row(i)
        return preference_from_row(row, self.columns, resolve=_resolver(root), source=source, index=index)


class SyntheticPreferencePairs:
    """Pairs from synthetic VQA records: chosen = the right answer, rejected = a wrong answer of the task."""

    def __init__(self, records, seed: int):
        self.records, self.seed = records, int(seed)
        self.name = f"synthetic_vqa_pairs({records.name})"
        self.vocabulary = sorted({a for answers in ANSWERS.values() for a in answers})

    def __len__(self) -> int:
        return len(self.records)

    def locate(self, i: int) -> tuple[str, int]:
        return self.records.locate(i)

    def identity(self) -> dict:
        return {"records": self.records.identity(), "seed": self.seed, "pairs": "synthetic_vqa"}

    def get(self, i: int) -> PreferenceRecord:
        rec = self.records.get(i)
        answer = str(rec.meta["answer"])
        wrong = [a for a in self.vocabulary if a != answer]
        rejected = random.Random(self.seed * 1_000_003 + i).choice(wrong)
        prompt = rec.messages[:-1]
        same_type = rejected in ANSWERS.get(rec.meta.get("question_type", ""), ())
        return PreferenceRecord(prompt, answer, rejected, rec.source, rec.index,
                                {**rec.meta, "rejected_same_type": same_type})


class ResponseHalves:
    """A pair source as SFT records: 2i = prompt + chosen, 2i + 1 = prompt + rejected (module docstring)."""

    def __init__(self, pairs):
        self.pairs = pairs
        self.name = f"{pairs.name}#halves"

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    def locate(self, k: int) -> tuple[str, int]:
        return self.pairs.locate(k // 2)

    def identity(self) -> dict:
        return {"pairs": self.pairs.identity(), "halves": 1}

    def get(self, k: int) -> Record:
        return self.pairs.get(k // 2).halves()[k % 2]
