"""LLaVA / ShareGPT "conversations" records converted into our messages form.

Much public SFT data is written in this layout rather than as {"messages": [...]}: LLaVA-Instruct
(llava_v1_5_mix665k.json, LLaVA-Instruct-150K), the "sharegpt" formatting of LLaMA-Factory and
ms-swift, and many Hugging Face datasets:

    {"id": "000", "image": "coco/train2017/000.jpg",            # or "images": [...]; none: text only
     "system": "...",                                           # optional
     "conversations": [{"from": "human", "value": "<image>\\nWhat is ...?"},
                       {"from": "gpt", "value": "..."}, ...]}

Roles: "human" -> user, "gpt" -> assistant, "system" -> system (only before the first other turn, and
not together with a top-level "system"), "observation" -> tool (a tool's reply), "function_call" -> an
assistant turn whose "value" is the call as JSON ({"name": ..., "arguments": ...} or a list of them,
LLaMA-Factory's form), trained as a `tool_calls` message; "user" / "assistant" are taken as they are. Any
other "from" value (e.g. raw ShareGPT's "bing") is an "invalid_record": a role is never guessed.

Media: each "<image>" / "<video>" marker in a turn's text is where the next image / video of the record's
"image" / "images" ("video" / "videos") goes: the marker is removed and an image (video) item put in its
place, the text around it kept as it is (so "<image>\\nWhat ...?" gives [image, "\\nWhat ...?"], the tokens
LLaVA, LLaMA-Factory and ms-swift train on). As many markers as media, else a "placeholder_mismatch": a
marker without an image, or an image without a marker, is never trained as if it were right. Markers in
an assistant turn are an "invalid_record" (assistant turns are text).

LLaVA-Video-178K (and LLaVA-NeXT's loader reading it) writes a video's place as "<image>": {"video": "x.mp4",
"conversations": [{"from": "human", "value": "<image>\\n..."}, ...]}. A record with videos and no images, no
"<video>" marker and exactly one "<image>" marker per video reads each "<image>" as the next video; any other
mix keeps the markers' own meaning, so e.g. an image, a video and one "<image>" is still a placeholder_mismatch.

The same marker placement (not the LLaVA-Video reading) applies to role / content messages whose contents are all
text and whose record gives
top-level media (ms-swift's standard layout: {"messages": [{"role": "user", "content": "<image>What ...?"}, ...],
"images": [...]}; `place_marked_media`).

The last turn must be the assistant's (a reply to train on): a conversation ending on the human is an
"invalid_record", as is an empty one; the rest of the checks are `messages.normalize_messages`'s.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError

__all__ = ["ROLE_OF", "is_conversation_turns", "messages_from_conversations", "media_list", "marked_text_messages",
           "place_marked_media", "refuse_markers_beside_items"]

ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
           "observation": "tool", "function_call": "assistant"}
"""ShareGPT "from" value -> our role."""

_MARKERS = {"image": "<image>", "video": "<video>"}
_KIND_OF = {m: k for k, m in _MARKERS.items()}
_SPLIT = re.compile("(<image>|<video>)")


def is_conversation_turns(raw: Any) -> bool:
    """Whether a list of turns is in the ShareGPT layout ({"from", "value"}), not ours ({"role", "content"})."""
    return (isinstance(raw, (list, tuple)) and bool(raw) and isinstance(raw[0], dict)
            and "from" in raw[0] and "role" not in raw[0])


def media_list(obj: dict, one: str, many: str) -> list:
    """A record's media refs from its `one` key (a ref, LLaVA's "image") or `many` key (a list); invalid_record
    when it has both. A list under "video" is one video's frames (as the "video" column of the prompt / answer
    layout reads), not a list of videos; a list under "image" is its images."""
    if obj.get(one) is not None and obj.get(many) is not None:
        raise BadRecordError("invalid_record", f"both {one!r} and {many!r} are given; use one of them")
    value = obj.get(many) if obj.get(many) is not None else obj.get(one)
    if value is None:
        return []
    if one == "video" and obj.get(many) is None:
        return [value]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _tool_calls(value: str, where: str) -> list[dict]:
    """The calls of a "function_call" turn: its value is JSON, {"name", "arguments"} or a list of them."""
    try:
        calls = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        raise BadRecordError("invalid_record", f"{where}: a 'function_call' value must be JSON "
                                               f"({{\"name\": ..., \"arguments\": ...}}), got {value!r:.80}") from None
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            raise BadRecordError("invalid_record", f"{where}: a 'function_call' needs a \"name\" and \"arguments\", "
                                                   f"got {call!r:.80}")
        out.append({"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
    return out


def _place_media(text: str, role: str, queues: dict[str, list], used: dict[str, int], where: str,
                 kinds: dict[str, str] = _KIND_OF) -> Any:
    """`text` with its markers replaced by the next media items (a list of items), or `text` when it has none;
    `kinds` maps each marker to the kind of media it stands for."""
    if "<image>" not in text and "<video>" not in text:
        return text
    if role == "assistant":
        raise BadRecordError("invalid_record", f"{where}: an <image> / <video> marker in a 'gpt' turn (media go in "
                                               "the other turns)")
    items: list[dict] = []
    for piece in _SPLIT.split(text):
        kind = kinds.get(piece)
        if kind is None:
            if piece:
                items.append({"type": "text", "text": piece})
            continue
        n = used[kind]
        used[kind] += 1
        if n < len(queues[kind]):
            items.append({"type": kind, kind: queues[kind][n]})
    return items


def _image_markers_are_videos(turns: Sequence[Any], queues: dict[str, list]) -> bool:
    """Whether the record's "<image>" markers stand for its videos (LLaVA-Video-178K's layout, which LLaVA-NeXT's
    loader reads this way): videos and no images, no "<video>" marker, and exactly one "<image>" marker per video.
    Anything else keeps the markers' own meaning (and its placeholder_mismatch), never a guess between the two."""
    if queues["image"] or not queues["video"]:
        return False
    texts = [t.get("value") for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]
    return (not any("<video>" in t for t in texts)
            and sum(t.count("<image>") for t in texts) == len(queues["video"]))


def messages_from_conversations(turns: Any, *, system: Optional[str] = None, images: Sequence[Any] = (),
                                videos: Sequence[Any] = (), key: str = "conversations") -> list[dict]:
    """Our raw messages (for `normalize_messages`) of ShareGPT `turns`, with `system` first and the media placed at
    their markers (see module docstring). Raises BadRecordError."""
    if not isinstance(turns, (list, tuple)):
        raise BadRecordError("invalid_record", f"{key!r} must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise BadRecordError("invalid_record", f"{key!r} is empty (nothing to train on)")
    if system is not None and not isinstance(system, str):
        raise BadRecordError("invalid_record", f"'system' must be a string, got {type(system).__name__}")
    queues = {"image": list(images), "video": list(videos)}
    kinds = {**_KIND_OF, "<image>": "video"} if _image_markers_are_videos(turns, queues) else _KIND_OF
    used = {"image": 0, "video": 0}
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadRecordError("invalid_record", f"{where} must be an object, got {type(turn).__name__}")
        source = turn.get("from")
        role = ROLE_OF.get(source) if isinstance(source, str) else None
        if role is None:
            raise BadRecordError("invalid_record", f"{where}: unknown 'from' value {source!r} (known: "
                                                   f"{sorted(ROLE_OF)})")
        value = turn.get("value")
        if not isinstance(value, str):
            raise BadRecordError("invalid_record", f"{where}.value must be a string, got {type(value).__name__}")
        if role == "system" and out:
            raise BadRecordError("invalid_record", f"{where}: a 'system' turn must come first"
                                                   + (" and not with a top-level 'system'" if system else ""))
        if source == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(value, where)})
            continue
        out.append({"role": role, "content": _place_media(value, role, queues, used, where, kinds)})
    if out[-1]["role"] != "assistant":
        raise BadRecordError("invalid_record", f"{key!r} ends on a {turns[-1].get('from')!r} turn, not the "
                                               "assistant's (no reply to train on)")
    for kind, refs in queues.items():
        if used[kind] != len(refs):
            many = f"{kind}s"
            raise BadRecordError("placeholder_mismatch", f"{used[kind]} {_MARKERS[kind]} markers in {key!r} but "
                                                         f"{len(refs)} {many} given")
    return out


def marked_text_messages(raw: Any) -> bool:
    """Whether role / content `raw` messages hold media markers in text contents and no content item lists
    (ms-swift's layout: the media are placed at the markers, `place_marked_media`)."""
    if not isinstance(raw, (list, tuple)) or not raw:
        return False
    contents = [m.get("content") if isinstance(m, dict) else None for m in raw]
    if any(isinstance(c, (list, tuple)) for c in contents):
        return False
    return any(isinstance(c, str) and ("<image>" in c or "<video>" in c) for c in contents)


def place_marked_media(raw: Sequence[dict], *, images: Sequence[Any] = (), videos: Sequence[Any] = (),
                       key: str = "messages") -> list[dict]:
    """`raw` role / content messages with each text marker replaced by the next image / video (module docstring);
    BadRecordError "placeholder_mismatch" unless markers and media are as many, "invalid_record" for a marker
    in an assistant turn."""
    queues = {"image": list(images), "video": list(videos)}
    used = {"image": 0, "video": 0}
    out = []
    for i, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None  # not a message: normalize_messages refuses it
        if isinstance(content, str):
            m = {**m, "content": _place_media(content, str(m.get("role")), queues, used, f"{key}[{i}]")}
        out.append(m)
    for kind, refs in queues.items():
        if used[kind] != len(refs):
            raise BadRecordError("placeholder_mismatch", f"{used[kind]} {_MARKERS[kind]} markers in {key!r} but "
                                                         f"{len(refs)} {kind}s given")
    return out


def refuse_markers_beside_items(raw: Any, kind: str, where: str) -> None:
    """BadRecordError "placeholder_mismatch" when `raw` messages, whose {"type": kind} items without a path are about
    to take the row's media, also hold "<kind>" markers in a text (a string content or a text item): the media would
    fill the items and the markers be trained as literal text, and which of the two places is meant is not guessed."""
    marker = _MARKERS[kind]
    for i, m in enumerate(raw if isinstance(raw, (list, tuple)) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        texts = [content] if isinstance(content, str) else [
            it.get("text") for it in content if isinstance(it, dict) and it.get("type") == "text"
        ] if isinstance(content, (list, tuple)) else []
        if any(isinstance(t, str) and marker in t for t in texts):
            raise BadRecordError("placeholder_mismatch", f"{where}[{i}]: a {marker} text marker beside {kind} items "
                                                         f"without a path; put the {kind}s either at markers in text "
                                                         f"contents or into {{\"type\": \"{kind}\"}} items, not both")
