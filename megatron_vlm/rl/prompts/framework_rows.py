"""GRPO prompt rows as verl and TRL store them, read as they are (no conversion step).

Why: a team moving from verl or TRL has its prompt sets already written in those layouts; reading
them directly keeps the data (and its reference answers) identical across the move.

verl (the parquet files its data preprocessing scripts write, e.g. examples/data_preprocess/gsm8k.py,
geo3k.py): columns `data_source` (str), `prompt` (list of {role, content} chat messages, content a
string), `images` (optional: list of {"bytes", "path"} structs, the Hugging Face Image feature, or
{"image": path} dicts), `ability`, `reward_model` ({"style": "rule", "ground_truth": str}) and
`extra_info` (a struct: split, index, ...). The reference answer is `reward_model.ground_truth`. Each
"<image>" in a message's text is where the next image goes, as verl's RLHFDataset places them; the
number of placeholders over all messages must equal the number of images (verl asserts the same).
`data_source`, `ability` and `extra_info` are kept in the sample's metadata (a custom reward gets
them as `metadata`, e.g. to call a verl `compute_score(data_source, solution_str, ground_truth,
extra_info)`).

TRL (GRPOTrainer datasets): a `prompt` column that is a string (standard format: one user turn) or a
list of chat messages (conversational format: content a string or a list of typed items
{"type": "image"} / {"type": "text", "text": ...}); images in an `images` column (a list) or an
`image` column (one image); a row with both set takes `images`, as GRPOTrainer does (a row whose
`images` is empty or null takes its `image`). As there, the
images of a message list whose content is a string go before the text of the first user turn, and
each {"type": "image"} item without an image of its own takes the next image; the counts must match.
A standard (string) prompt with images is refused (GRPOTrainer requires conversational prompts for
images). TRL passes every other column to its reward functions by name; there is no fixed reference
column, so the reference is the first of `ground_truth`, `answer`, `solution` the file has (the names
TRL's documentation and built-in rewards use: `ground_truth` in the reward-function examples,
`solution` in `trl.rewards.accuracy_reward`). `answer` comes before `solution` because datasets with
both (e.g. a worked solution and its final answer) hold the short answer there, which is what the
verifiers compare against. The other columns are kept in the metadata.

Both: the user text of the last user turn goes through `[rl.prompts] template` (its images stay where
they were); rows that cannot be used (no ground truth, image count != placeholders, a video, an
image URL, an empty question, ...) raise BadRecordError and are skipped and counted by the caller.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.data_files import DataFileError

__all__ = ["TRL_REFERENCE_COLUMNS", "VERL_COLUMNS", "trl_answer_column", "from_verl_row", "from_trl_row"]

VERL_COLUMNS = ("prompt", "reward_model")
"""The columns that make a table verl's (a TRL table has `prompt` too: `reward_model` decides)."""
TRL_REFERENCE_COLUMNS = ("ground_truth", "answer", "solution")
"""Reference-answer columns of a TRL table, the first present wins (module docstring)."""
VERL_PLACEHOLDER = "<image>"
_ROLES = ("system", "user", "assistant")
_TEXT_SLOT = "\x00image\x00"  # where an image sits while the template is applied (no dataset text holds it)

ImageRef = Callable[[Any, Path, str], Any]


class _Image:
    """An image of a turn, in its place among the text pieces."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any):
        self.ref = ref


def trl_answer_column(columns: Sequence[str], file: Any) -> str:
    """The reference column of a TRL table (module docstring); DataFileError naming the file if it has none."""
    cols = set(columns)
    answer = next((c for c in TRL_REFERENCE_COLUMNS if c in cols), None)
    if answer is None:
        raise DataFileError(f"{file}: a TRL prompt table (a 'prompt' column) needs its reference answer in one of the "
                            f"columns {list(TRL_REFERENCE_COLUMNS)} (has {sorted(cols)})")
    return answer


def _foreign_image(value: Any, root: Path, row_id: str, image_ref: ImageRef) -> Any:
    """An image entry as verl / TRL write them: a {"bytes", "path"} struct, an {"image": path} dict
    (qwen-vl-utils style), a path (optionally "file://"), or bytes; URLs are refused (nothing is fetched)."""
    if isinstance(value, dict) and not value.get("bytes") and not value.get("path") and isinstance(value.get("image"), str):
        value = value["image"]
    if isinstance(value, dict) and not value.get("bytes") and isinstance(value.get("path"), str):
        value = value["path"]
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise BadRecordError("invalid_record", f"image URL {value[:80]!r}: images are read from local files only")
        if value.startswith("file://"):
            value = value[len("file://"):]
    return image_ref(value, root, row_id)


def _split_placeholders(text: str, images: list, taken: int) -> tuple[list, int]:
    """`text` cut at each "<image>" into text pieces and the next images; (pieces, images taken so far)."""
    parts = text.split(VERL_PLACEHOLDER)
    pieces: list = []
    for k, part in enumerate(parts):
        if part:
            pieces.append(part)
        if k < len(parts) - 1:
            if taken >= len(images):  # counted over all turns before this is reached; kept as a guard
                raise BadRecordError("placeholder_mismatch", f"more {VERL_PLACEHOLDER} placeholders than the {len(images)} images")
            pieces.append(_Image(images[taken]))
            taken += 1
    return pieces, taken


def _build(turns: list[tuple[str, list]], template: str, system_prompt: Optional[str]) -> tuple[list[dict], str]:
    """Our prompt messages from (role, pieces) turns: the last user turn's text goes through `template`
    with its images kept in place; returns (messages, the question without images)."""
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise BadRecordError("invalid_record", "the prompt has no user turn")
    if turns[-1][0] == "assistant":
        raise BadRecordError("invalid_record", "the prompt ends with an assistant turn (a GRPO prompt is answered by the policy)")
    messages: list[dict] = []
    if system_prompt and not any(role == "system" for role, _ in turns):
        messages.append({"role": "system", "content": system_prompt})
    problem = ""
    for i, (role, pieces) in enumerate(turns):
        if role == "system":
            if any(isinstance(p, _Image) for p in pieces):
                raise BadRecordError("invalid_record", "an image in the system turn")
            messages.append({"role": "system", "content": "".join(pieces)})
            continue
        if i == users[-1]:
            problem = "".join(p for p in pieces if isinstance(p, str)).strip()
            if not problem:
                raise BadRecordError("invalid_record", "empty question")
            images = [p for p in pieces if isinstance(p, _Image)]
            marked = "".join(_TEXT_SLOT if isinstance(p, _Image) else p for p in pieces).strip()
            rendered = template.format(problem=marked).split(_TEXT_SLOT)
            if len(rendered) != len(images) + 1:  # a template that repeats {problem} would repeat the images
                raise BadRecordError("placeholder_mismatch", "the prompt template repeats {problem} around images")
            pieces = [x for k, part in enumerate(rendered) for x in ([part] + ([images[k]] if k < len(images) else []))]
        content: list[dict] = []
        for p in pieces:
            if isinstance(p, _Image):
                content.append({"type": "image", "image": p.ref})
            elif p.strip():
                content.append({"type": "text", "text": p.strip()})
        messages.append({"role": role, "content": content})
    return messages, problem


def _message_list(prompt: Any) -> list[dict]:
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise BadRecordError("invalid_record", f"'prompt' must be a non-empty list of messages, got {type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRecordError("invalid_record", f"prompt[{i}]: expected a message with role "
                                                   f"{'/'.join(_ROLES)}, got {str(m)[:60]!r}")
    return list(prompt)


def _reference(value: Any, where: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BadRecordError("invalid_record", f"no reference answer ({where} is empty)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRecordError("invalid_record", f"{where} is a {type(value).__name__}; the verifiers compare against "
                                               "one string or number")
    return str(value).strip()


def _plain(value: Any) -> bool:
    """Metadata keeps values a reward function can read as JSON (not image bytes)."""
    if value is None:
        return False
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def from_verl_row(row: dict, root: Path, row_id: str, template: str, system_prompt: Optional[str],
                  image_ref: ImageRef) -> tuple[list[dict], str, str, dict]:
    """(messages, question, reference, metadata) of one verl row; BadRecordError if it cannot be used."""
    rm = row.get("reward_model")
    if not isinstance(rm, dict):
        raise BadRecordError("invalid_record", "reward_model: expected a struct with 'ground_truth', "
                                               f"got {type(rm).__name__}")
    answer = _reference(rm.get("ground_truth"), "reward_model.ground_truth")
    if row.get("videos"):
        raise BadRecordError("invalid_record", "videos are not read for GRPO prompts")
    prompt = _message_list(row.get("prompt"))
    raw = row.get("images") or []
    if not isinstance(raw, (list, tuple)):
        raw = [raw]
    texts = []
    for i, m in enumerate(prompt):
        content = m.get("content")
        if not isinstance(content, str):
            raise BadRecordError("invalid_record", f"prompt[{i}].content: verl writes a string, got {type(content).__name__}")
        if "<video>" in content:
            raise BadRecordError("invalid_record", "videos are not read for GRPO prompts")
        texts.append(content)
    slots = sum(t.count(VERL_PLACEHOLDER) for t in texts)
    if slots != len(raw):
        raise BadRecordError("placeholder_mismatch", f"{slots} {VERL_PLACEHOLDER} placeholders but {len(raw)} images")
    images = [_foreign_image(v, root, row_id, image_ref) for v in raw]
    turns, taken = [], 0
    for m, text in zip(prompt, texts):
        pieces, taken = _split_placeholders(text, images, taken)
        turns.append((m["role"], pieces))
    messages, problem = _build(turns, template, system_prompt)
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "images", "videos") and _plain(v)}
    return messages, problem, answer, metadata


def from_trl_row(row: dict, root: Path, row_id: str, template: str, system_prompt: Optional[str], image_ref: ImageRef,
                 answer_col: str) -> tuple[list[dict], str, str, dict]:
    """(messages, question, reference, metadata) of one TRL row; BadRecordError if it cannot be used."""
    answer = _reference(row.get(answer_col), f"column {answer_col!r}")
    raw = row.get("images")
    if not raw:
        raw = [] if row.get("image") is None else [row["image"]]
    elif not isinstance(raw, (list, tuple)):
        raw = [raw]
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if raw:
            raise BadRecordError("invalid_record", "images with a standard (string) prompt: images need a conversational "
                                                   "prompt (a list of messages), as TRL's GRPOTrainer requires")
        prompt = [{"role": "user", "content": prompt}]
    prompt = _message_list(prompt)
    images = [_foreign_image(v, root, row_id, image_ref) for v in raw]
    turns: list[tuple[str, list]] = []
    placed, pending = False, 0  # images before the first user string; typed placeholders take the rest in order
    for i, m in enumerate(prompt):
        content, role = m.get("content"), m["role"]
        pieces: list = []
        if isinstance(content, str):
            if role == "user" and not placed:
                pieces = [_Image(None) for _ in images]
                pending += len(images)
                placed = True
            pieces.append(content)
        elif isinstance(content, (list, tuple)):
            for it in content:
                kind = it.get("type") if isinstance(it, dict) else None
                if kind == "text":
                    pieces.append(str(it.get("text") or ""))
                elif kind == "image" and it.get("image") is not None:
                    pieces.append(_Image(_foreign_image(it["image"], root, row_id, image_ref)))
                elif kind == "image":
                    pieces.append(_Image(None))
                    pending += 1
                else:
                    raise BadRecordError("invalid_record", f"prompt[{i}]: unsupported content item {str(it)[:60]!r} "
                                                           "(text and image items are read)")
        else:
            raise BadRecordError("invalid_record", f"prompt[{i}].content must be a string or a list, "
                                                   f"got {type(content).__name__}")
        turns.append((role, pieces))
    if pending != len(images):
        raise BadRecordError("placeholder_mismatch", f"{pending} image placeholders but {len(images)} images")
    fill = iter(images)
    for _, pieces in turns:
        for p in pieces:
            if isinstance(p, _Image) and p.ref is None:
                p.ref = next(fill)
    messages, problem = _build(turns, template, system_prompt)
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "image", "images") and _plain(v)}
    return messages, problem, answer, metadata
