"""Messages-format records and the messages JSONL reader (on the shared reader, `table_rows`).

One JSON object per line (or a file that is one JSON array of such objects, e.g. a `.json` file named
directly: its elements are the records, a bad one counted by its 0-based index; see table_rows):

    {"messages": [
        {"role": "system", "content": "..."},                                   # optional
        {"role": "user", "content": [{"type": "image", "image": "img/a.png"},
                                     {"type": "video", "video": ["f0.png", "f1.png"], "fps": 2.0},
                                     {"type": "text", "text": "What is ...?"}]},
        {"role": "assistant", "content": "..."},
        ... any number of further user / assistant turns ...
    ], "answer": "...", ...}                                                     # other keys -> meta

Media may also sit next to the messages: image / video items without a path ({"type": "image"}, as
TRL's vision datasets write them) take the line's top-level "images" / "videos" in order; media that
no item takes is a "placeholder_mismatch". Messages whose contents are all text with "<image>" / "<video>"
markers (ms-swift's and LLaMA-Factory's layout: {"messages": [{"role": "user", "content": "<image>What ...?"},
...], "images": [...]}) get the media at their markers instead, as conversations do (conversations.py).

LLaVA / ShareGPT records ({"conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt",
...}], "image" / "images", "system", ...}: LLaVA-Instruct, LLaMA-Factory's and ms-swift's "sharegpt" files)
are converted into this form line by line (a file may mix both), each "<image>" / "<video>" marker becoming
the next image / video item in place: see conversations.py for the roles, the markers and what is refused.
TRL's conversational prompt-completion lines ({"prompt": [messages], "completion": [one assistant message] or a
string, "images": [...]}) are the prompt's turns then the completion, read as a "messages" line (media included),
with the hf source's checks (prompt_completion.py); a text "prompt" (TRL's standard form) is an "invalid_record"
naming the `hf` columns that read it.

An image may also be embedded as a base64 data URL ("data:image/png;base64,...", e.g. in an
OpenAI-style {"type": "image_url", "image_url": {"url": ...}} item); it becomes the image's bytes.
transformers' own item keys are read as its `apply_chat_template` reads them: {"type": "image", "url" | "path" |
"base64": ...} ("base64": the encoded file, or a data URL) and {"type": "video", "url" | "path": ...}; a local file
may be written as a "file://" URL (qwen-vl-utils' form, "file:///data/a.png"), which is its path.
A video is a list of frame paths, a folder of frames (in frame-number order) or a video file (decoded
with PyAV when it is installed, see media.py). Relative paths
resolve against `image_root`, else the JSONL file's folder.

Tool-use traces follow the OpenAI / transformers format: an assistant message may carry "tool_calls"
([{"type": "function", "function": {"name": ..., "arguments": {...} or "<json>"}}]; content may then be
empty or null), the tool's reply is a "tool" message, and the record's top-level "tools" lists the tool
specs. Both reach the chat template as `apply_chat_template(messages, tools=...)` passes them (the calls
are part of the trained assistant turn); a template that does not render them (calls or specs) is refused per record
(processor_base.py), never trained without them. An assistant message's "reasoning_content" (reasoning traces
written apart from the answer) reaches the template the same way; Qwen3's renders it inside the turn
(<think>...</think>, for the turns after the last user message), and a template that renders no reasoning at all
is refused per record. `normalize_messages` is shared with the
HF-datasets source: it checks the structure and raises `BadRecordError("invalid_record", ...)`
naming the offending message / item; the reader logs bad lines (file, 1-based line or 0-based array element) and goes on
(a line that is not UTF-8 or not parseable JSON, see table_rows; any other exception for one line
is counted as "unexpected_error").
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.conversations import (
    is_conversation_turns,
    marked_text_messages,
    media_list,
    messages_from_conversations,
    place_marked_media,
    refuse_markers_beside_items,
)
from megatron_vlm.data.data_files import MESSAGES_RECORD_KEYS, MESSAGES_SUFFIXES
from megatron_vlm.data.prompt_completion import completion_turns, prompt_turns
from megatron_vlm.data.table_rows import TableRows

__all__ = ["Record", "normalize_messages", "normalize_tools", "read_messages_jsonl", "record_from_messages_row", "resolve_path",
           "local_path", "image_item_ref"]

ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool's reply in a tool-use trace (not trained)


@dataclass
class Record:
    messages: list[dict]
    """Normalised messages: content is a string, or a list of {"type": "text", "text": str},
    {"type": "image", "image": ref}, {"type": "video", "video": ref, "fps"?: float}; a ref is an
    absolute path, bytes, a PIL image, or a list of those (video frames). Assistant content is a string;
    an assistant message may carry "tool_calls" (the model's calls, rendered by the chat template) and
    "reasoning_content" (its reasoning, a string, rendered by reasoning templates such as Qwen3's)."""
    source: str
    """File (or dataset) the record came from."""
    index: int
    """1-based line (JSONL), 0-based element (a JSON array file) or 0-based row (HF dataset)."""
    meta: dict = field(default_factory=dict)
    """Other top-level fields (e.g. "answer", "question_type"; "tools": the tool specs the chat template
    renders, see `tools`)."""

    @property
    def tools(self) -> Optional[list[dict]]:
        """The record's tool specs (top-level "tools"), handed to the chat template as transformers'
        `apply_chat_template(..., tools=...)` does."""
        return normalize_tools(self.meta.get("tools"))

    def images(self) -> list:
        return [it["image"] for m in self.messages if not isinstance(m["content"], str)
                for it in m["content"] if it["type"] == "image"]

    def videos(self) -> list[dict]:
        return [it for m in self.messages if not isinstance(m["content"], str)
                for it in m["content"] if it["type"] == "video"]


_FILE_URL = "file://"


def local_path(ref: Any) -> Any:
    """A "file://" URL's path ("file:///data/a.png" -> "/data/a.png", as qwen-vl-utils reads it); other refs
    unchanged."""
    return ref[len(_FILE_URL):] if isinstance(ref, str) and ref.startswith(_FILE_URL) else ref


def resolve_path(ref: Any, root: Optional[Path]) -> Any:
    """Make a relative string path (or "file://" URL) absolute against `root`; other refs are returned unchanged."""
    if isinstance(ref, os.PathLike):
        ref = os.fspath(ref)
    ref = local_path(ref)
    if isinstance(ref, str) and root is not None and not os.path.isabs(ref) and "://" not in ref:
        return str(root / ref)
    return ref


def _item_type(item: dict, where: str) -> str:
    t = item.get("type")
    if t in ("image", "video", "text"):
        return t
    if t == "image_url" or "image" in item or "image_url" in item:
        return "image"
    if "video" in item:
        return "video"
    if "text" in item:
        return "text"
    raise BadRecordError("invalid_record", f"{where}: unknown content item type {t!r} (keys {sorted(item)})")


def _data_url_bytes(url: str, where: str) -> bytes:
    """The image bytes of a "data:<type>;base64,<data>" URL (OpenAI-style image_url items embed images so;
    transformers' load_image reads them too), not a file name to resolve; bad base64 is a corrupt image."""
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise BadRecordError("invalid_record", f"{where}: a data URL image must be base64 (data:<type>;base64,...), "
                                               f"got {head[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise BadRecordError("corrupt_image", f"{where}: the data URL is not valid base64 ({e})") from None


def _base64_bytes(value: Any, where: str) -> bytes:
    """The image bytes of a "base64" item: the encoded file (line breaks allowed, as `base64.decodebytes` reads it) or
    a data URL; anything else is a corrupt image."""
    if isinstance(value, str) and value.startswith("data:"):
        return _data_url_bytes(value, where)
    if not isinstance(value, str):
        raise BadRecordError("invalid_record", f"{where}: 'base64' must be a string, got {type(value).__name__}")
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except binascii.Error as e:
        raise BadRecordError("corrupt_image", f"{where}: 'base64' is not valid base64 ({e})") from None


def _normalize_item(item: Any, where: str, resolve: Callable[[Any], Any]) -> dict:
    if not isinstance(item, dict):
        raise BadRecordError("invalid_record", f"{where}: content item must be an object, got {type(item).__name__}")
    item = {k: v for k, v in item.items() if v is not None}  # arrow structs carry None for absent keys
    t = _item_type(item, where)
    if t == "text":
        if not isinstance(item.get("text"), str):
            raise BadRecordError("invalid_record", f"{where}: text item needs a string 'text'")
        return {"type": "text", "text": item["text"]}
    if t == "image":
        ref = next((item[k] for k in ("image", "image_url", "url", "path") if k in item), None)
        if ref is None and "base64" in item:  # transformers' {"type": "image", "base64": ...}
            return {"type": "image", "image": _base64_bytes(item["base64"], where)}
        if isinstance(ref, dict) and "url" in ref:
            ref = ref["url"]
        if isinstance(ref, str) and ref.startswith("data:"):
            return {"type": "image", "image": _data_url_bytes(ref, where)}
        return {"type": "image", "image": None if ref is None else resolve(local_path(ref))}
    ref = next((item[k] for k in ("video", "url", "path") if k in item), None)
    if isinstance(ref, (list, tuple)):
        if not ref:
            raise BadRecordError("invalid_record", f"{where}: video frame list is empty")
        ref = [resolve(local_path(r)) for r in ref]
    elif ref is not None:
        ref = resolve(local_path(ref))
    out = {"type": "video", "video": ref}
    if "fps" in item:
        try:
            fps = float(item["fps"])
        except (TypeError, ValueError):
            raise BadRecordError("invalid_record", f"{where}: fps must be a number, got {item['fps']!r}") from None
        if fps <= 0:
            raise BadRecordError("invalid_record", f"{where}: fps must be > 0, got {fps}")
        out["fps"] = fps
    return out


def image_item_ref(item: dict, where: str) -> Any:
    """The image an {"type": "image", ...} item names, under any key the public formats use ("image", "image_url",
    "url", "path", "base64"; a data URL or base64 text as bytes, a "file://" URL as its path; relative paths left
    as written), or None for an item without one (it takes the row's next image)."""
    return _normalize_item(item, where, lambda ref: ref)["image"]


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _normalize_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (OpenAI / transformers format: {"type": "function", "function":
    {"name", "arguments"}} or {"name", "arguments"}), checked; absent keys of arrow structs dropped."""
    if not isinstance(calls, (list, tuple)):
        raise BadRecordError("invalid_record", f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRecordError("invalid_record", f"{w} must be an object, got {type(call).__name__}")
        call = _drop_none(call)
        if isinstance(call.get("function"), dict):
            call["function"] = fn = _drop_none(call["function"])
        else:
            fn = call
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRecordError("invalid_record", f"{w}: a tool call needs a function name (string)")
        if not isinstance(fn.get("arguments"), (dict, str)):
            raise BadRecordError("invalid_record", f"{w}: the arguments of {fn['name']!r} must be an object or a JSON "
                                                   f"string, got {type(fn.get('arguments')).__name__}")
        out.append(call)
    return out


def normalize_tools(tools: Any) -> Optional[list[dict]]:
    """A record's top-level `tools` (the tool specs `apply_chat_template(..., tools=...)` renders; a JSON
    string of them, as table columns often hold them, is parsed), checked; None or [] when it has none."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError as e:
            raise BadRecordError("invalid_record", f"'tools' is a string but not JSON ({e})") from None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise BadRecordError("invalid_record", f"'tools' must be a list of tool specs (objects), got {tools!r:.80}")
    return list(tools)


def normalize_messages(raw: Any, resolve: Callable[[Any], Any] = lambda r: r) -> list[dict]:
    """Check and normalise a messages list (see `Record.messages`); raises BadRecordError."""
    if not isinstance(raw, list) or not raw:
        raise BadRecordError("invalid_record", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRecordError("invalid_record", f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRecordError("invalid_record", f"{where}.role must be one of {ROLES}, got {role!r}")
        content = m.get("content")
        calls = None
        if m.get("tool_calls"):  # an empty list (tables write one on every message) is no call
            if role != "assistant":
                raise BadRecordError("invalid_record", f"{where}: only assistant messages carry tool_calls, not {role!r}")
            calls = _normalize_tool_calls(m["tool_calls"], where)
            if content is None:  # a call-only turn (OpenAI writes content: null)
                content = ""
        reasoning = m.get("reasoning_content")
        if reasoning is not None and reasoning != "":  # null / "" (tables write them) is no reasoning
            if role != "assistant":
                raise BadRecordError("invalid_record", f"{where}: only assistant messages carry reasoning_content, "
                                                       f"not {role!r}")
            if not isinstance(reasoning, str):
                raise BadRecordError("invalid_record", f"{where}.reasoning_content must be a string, got "
                                                       f"{type(reasoning).__name__}")
        if isinstance(content, str):
            items: Any = content
        elif isinstance(content, (list, tuple)):
            items = [_normalize_item(it, f"{where}.content[{j}]", resolve) for j, it in enumerate(content)]
        else:
            raise BadRecordError("invalid_record", f"{where}.content must be a string or a list, "
                                                   f"got {type(content).__name__}")
        if role == "assistant" and not isinstance(items, str):
            if any(it["type"] != "text" for it in items):
                raise BadRecordError("invalid_record", f"{where}: assistant content must be text only")
            items = "".join(it["text"] for it in items)
        out.append({"role": role, "content": items, **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": reasoning} if reasoning else {})})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecordError("invalid_record", "no assistant turn (nothing to train on)")
    return out


_MEDIA_KEYS = (("image", "images"), ("video", "videos"))


def _fill_media_items(messages: list[dict], obj: dict, resolve: Callable[[Any], Any]) -> None:
    """Give the image / video items without a path the line's top-level "images" / "videos" (or "image" / "video",
    `media_list`) in order (TRL's
    vision datasets: {"type": "image"} items + "images"); BadRecordError "placeholder_mismatch" for media that
    no item takes (e.g. LLaMA-Factory's "<image>" text markers, which are not image items) or items left over."""
    for kind, key in _MEDIA_KEYS:
        refs = media_list(obj, kind, key)  # LLaVA's singular "image" too ("video": one video, a list its frames)
        empty = [it for m in messages if not isinstance(m["content"], str)
                 for it in m["content"] if it["type"] == kind and it[kind] is None]
        if not refs and not empty:
            continue
        if refs:
            refuse_markers_beside_items(messages, kind, "messages")
        if len(empty) != len(refs):
            raise BadRecordError("placeholder_mismatch", f"{len(empty)} {kind} items without a path in the messages "
                                                         f"but {len(refs)} {key} in {key!r} (text markers such as "
                                                         f"'<{kind}>' are not {kind} items: write {{\"type\": "
                                                         f"\"{kind}\"}} items)")
        for j, (it, ref) in enumerate(zip(empty, refs)):
            it[kind] = _normalize_item({"type": kind, kind: ref}, f"{key}[{j}]", resolve)[kind]


_CONVERSATION_KEYS = ("system", "image", "images", "video", "videos")


def _record_from_conversations_row(obj: dict, resolve: Callable[[Any], Any], *, source: str, index: int,
                                   key: str = "conversations") -> Record:
    """The `Record` of one LLaVA / ShareGPT {"conversations": [{"from", "value"}, ...], ...} object (see
    conversations.py); its "system", "image(s)", "video(s)" are part of the conversation, other keys `meta`."""
    if key == "conversations" and "messages" in obj:
        raise BadRecordError("invalid_record", "both 'messages' and 'conversations' are given; which one to train "
                                               "on is not guessed")
    messages = normalize_messages(messages_from_conversations(
        obj[key], system=obj.get("system"), images=media_list(obj, "image", "images"),
        videos=media_list(obj, "video", "videos"), key=key), resolve)
    normalize_tools(obj.get("tools"))
    for m in messages:
        if not isinstance(m["content"], str):
            for it in m["content"]:
                if it["type"] in ("image", "video") and it[it["type"]] is None:
                    raise BadRecordError("invalid_record", f"an {it['type']} of the record is null")
    return Record(messages, source, index, {k: v for k, v in obj.items() if k != key and k not in _CONVERSATION_KEYS})


def _prompt_completion_as_messages(obj: dict) -> dict:
    """`obj`, a TRL prompt-completion row, with "messages" (the prompt's turns, then the completion) in place of its
    "prompt" and "completion" (prompt_completion.py: the checks the hf source makes of the same row)."""
    if not isinstance(obj["prompt"], (list, tuple)):
        raise BadRecordError("invalid_record", "'prompt' is not a list of messages (TRL's standard, text-only "
                                               "prompt-completion): read such a file with data.type = \"hf\" and "
                                               "columns = {prompt = \"prompt\", answer = \"completion\"}")
    raw = prompt_turns(obj["prompt"], "prompt") + completion_turns(obj["completion"], "completion")
    return {**{k: v for k, v in obj.items() if k not in ("prompt", "completion")}, "messages": raw}


def record_from_messages_row(obj: dict, resolve: Callable[[Any], Any], *, source: str, index: int) -> Record:
    """The `Record` of one {"messages": [...], ...} object; top-level "images" / "videos" fill the media items
    without a path (`_fill_media_items`); other keys become `meta`. A LLaVA / ShareGPT {"conversations": [...]}
    object (or "messages" of {"from", "value"} turns) is converted (conversations.py), as is a TRL {"prompt": [...],
    "completion": ...} object (`_prompt_completion_as_messages`). Raises BadRecordError."""
    if "conversations" in obj:
        return _record_from_conversations_row(obj, resolve, source=source, index=index)
    if "messages" not in obj and "prompt" in obj and "completion" in obj:  # TRL's prompt-completion
        obj = _prompt_completion_as_messages(obj)
    if "messages" not in obj:
        raise BadRecordError("invalid_record", f"no 'messages' or 'conversations' key (keys: {sorted(obj)[:8]})")
    if is_conversation_turns(obj["messages"]):  # LLaMA-Factory's sharegpt files may name the turns "messages"
        return _record_from_conversations_row(obj, resolve, source=source, index=index, key="messages")
    raw = obj["messages"]
    if marked_text_messages(raw) and any(obj.get(k) is not None for k in _CONVERSATION_KEYS[1:]):
        # ms-swift's layout: text contents with "<image>" markers and top-level "images" (or LLaVA's one "image"):
        # placed at the markers
        obj = {**obj, "messages": place_marked_media(raw, images=media_list(obj, "image", "images"),
                                                     videos=media_list(obj, "video", "videos"))}
        for k in _CONVERSATION_KEYS[1:]:
            obj.pop(k, None)
        messages = normalize_messages(obj["messages"], resolve)
        normalize_tools(obj.get("tools"))
        return Record(messages, source, index, {k: v for k, v in obj.items() if k != "messages"})
    messages = normalize_messages(raw, resolve)
    normalize_tools(obj.get("tools"))
    _fill_media_items(messages, obj, resolve)
    for m in messages:
        if not isinstance(m["content"], str):
            for it in m["content"]:
                if it["type"] in ("image", "video") and it[it["type"]] is None:
                    raise BadRecordError("invalid_record", f"an {it['type']} item has no path")
    return Record(messages, source, index, {k: v for k, v in obj.items() if k not in ("messages", *_CONVERSATION_KEYS[1:])})


def read_messages_jsonl(path: str | os.PathLike, *, image_root: str | os.PathLike | None = None,
                        bad_records: Optional[BadRecordLog] = None) -> list[Record]:
    """All well-formed records of the messages JSONL file(s) at `path` (a file, a folder of .jsonl
    files searched recursively, or a glob), in file then line order; bad lines go to `bad_records`
    (or are dropped) under their file and 1-based line (0-based element of a JSON array file)."""
    rows = TableRows(path, suffixes=MESSAGES_SUFFIXES, bad_records=bad_records, record_keys=MESSAGES_RECORD_KEYS)
    records: list[Record] = []
    for i in range(len(rows)):
        source, lineno = rows.locate(i)
        root = Path(image_root) if image_root else Path(source).resolve().parent
        try:
            records.append(record_from_messages_row(rows.row(i), lambda ref: resolve_path(ref, root),
                                                    source=source, index=lineno))
        except Exception as e:  # every per-record failure is a counted bad record (unexpected ones by type)
            if bad_records is not None:
                bad_records.add_error(source, lineno, unexpected(e, f"{source}:{lineno}"))
    return records
