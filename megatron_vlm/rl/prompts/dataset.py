"""GRPO prompt datasets: Geometry3K, ViRL39K, messages-format JSONL, verl and TRL tables, read from local files.

The files are found and read by the data pipeline's reader (`megatron_vlm.data.table_rows`, the one
SFT uses): a file, a folder searched recursively or a glob of .parquet / .arrow / .jsonl / .json files, the
same rows in the same order, bad rows named by the same file and line / row. This module maps those
rows to prompts.

A prompt sample is a chat prompt (system turn optional, one user turn with images and text, no
assistant turn) plus the reference answer the reward verifiers compare against. Messages use the
normalised structure of megatron_vlm.data.messages: user content is a list of
{"type": "image", "image": ref} and {"type": "text", "text": str} items, where ref is an absolute
path or the image's encoded bytes (decoded later by the data pipeline's processor).

Schemas (column names of the public releases):
    geometry3k  (hiyouga/geometry3k)   images: list of images ({bytes, path} structs or paths),
                                       problem: str with "<image>" placeholders, answer: str
    virl39k     (TIGER-Lab/ViRL39K)    question: str with "<image>" placeholders, answer: str
                                       (usually "\\boxed{...}"), image: list of paths relative to
                                       the release folder ("images/..."), qid, category, source,
                                       PassRate_32BTrained, PassRate_7BBase
    messages    ({"messages": [...], "answer": ...} JSONL, e.g. the synthetic VQA eval set): the
                                       turns before the last assistant turn are the prompt; the
                                       reference is "answer", else the last assistant turn; a
                                       top-level "images" goes to "<image>" text markers or to
                                       image items without a path (as SFT reads them)
    verl        (verl's preprocessed parquet)  prompt: chat messages with "<image>" placeholders,
                                       images, reward_model.ground_truth, data_source, ability,
                                       extra_info (rl/prompts/framework_rows.py)
    trl         (TRL GRPOTrainer datasets)     prompt: a string or chat messages, image / images,
                                       the reference in ground_truth, answer or solution
                                       (rl/prompts/framework_rows.py)

Detection (`detect_schema`) goes by column names: `prompt` with `reward_model` is verl, `prompt`
without it TRL (TRL's trainer reads `prompt` even where a `messages` column is kept beside it), then
`messages`, then the Geometry3K and ViRL39K column sets.

The user text is `prompt_template.format(problem=...)` ([rl] prompt_template). Images go where the
"<image>" placeholders are; a row without placeholders gets its images before the text (about 2% of
ViRL39K rows lost theirs in conversion). Rows that cannot be used (missing image file, more
placeholders than images, empty question or answer; a JSON line that is not UTF-8 or nested too
deeply to parse; any other exception while mapping one row, as "unexpected_error") are skipped,
listed in `skipped` with the reason and counted in `bad_records` with the SFT categories, so one
bad row does not stop a run.
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.conversations import (
    marked_text_messages,
    media_list,
    place_marked_media,
    refuse_markers_beside_items,
)
from megatron_vlm.data.data_files import HF_SUFFIXES, RECORD_KEYS, DataFileError, record_columns
from megatron_vlm.data.messages import Record, image_item_ref, local_path
from megatron_vlm.data.table_rows import TableRows
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.framework_rows import (
    _TEXT_SLOT,
    TRL_REFERENCE_COLUMNS,
    VERL_COLUMNS,
    from_trl_row,
    from_verl_row,
    trl_answer_column,
)

__all__ = [
    "IMAGE_PLACEHOLDER",
    "SCHEMAS",
    "PromptSample",
    "PromptDataset",
    "detect_schema",
    "load_prompt_dataset",
    "prompt_batches",
]

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
Schema = Literal["auto", "geometry3k", "virl39k", "messages", "verl", "trl"]
SCHEMAS = ("geometry3k", "virl39k", "messages", "verl", "trl")
# (a load with an explicit `columns` mapping reports schema "columns", or the preset it equals)
_SCHEMA_COLUMNS = {
    "geometry3k": ("problem", "answer", "images"),
    "virl39k": ("question", "answer", "image"),
}
_VIRL_META = ("category", "source", "PassRate_32BTrained", "PassRate_7BBase")


@dataclass
class PromptSample:
    prompt_id: str
    """Stable id: the dataset's id column (ViRL39K qid) or "<file>:<row>"."""
    messages: list[dict]
    """Chat prompt without an assistant turn (see module docstring)."""
    answer: str
    """Reference answer for the verifiers."""
    problem: str
    """The question text without image placeholders (passed to verifiers as `prompt`, e.g. to read
    multiple-choice options)."""
    metadata: dict = field(default_factory=dict)
    """Other columns (category, source, pass rates, question_type, choices, ...)."""

    def images(self) -> list:
        return [it["image"] for m in self.messages if isinstance(m["content"], list) for it in m["content"] if it["type"] == "image"]

    source: str = ""
    """The data file the row came from (empty for samples built in code)."""
    index: int = -1
    """The row's place in `source`: 1-based line of a JSONL file, 0-based row of a table."""

    def to_record(self, source: str = "", index: int = -1) -> Record:
        """The sample as a `megatron_vlm.data.messages.Record` whose last assistant turn is the
        reference answer: `process_record(record, proc, for_generation=True)` then gives the
        generation prompt's tokens and vision inputs, with the answer in `.answer`."""
        meta = dict(self.metadata, prompt_id=self.prompt_id, problem=self.problem, answer=self.answer)
        return Record(self.messages + [{"role": "assistant", "content": self.answer}], source or self.prompt_id, index, meta)


@dataclass
class PromptDataset:
    samples: list[PromptSample]
    schema: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(row id, reason) of rows that were left out."""
    bad_records: BadRecordLog = field(default_factory=BadRecordLog)
    """The same rows by (file, line / row, category), counted as the SFT data loader counts them."""
    files: list[Path] = field(default_factory=list)
    """The files the prompts were read from, in reading order (a GRPO checkpoint records their content)."""
    start_lengths: Optional[Any] = None
    """The token lengths the start-up filter measured the prompts with (`lengths.PromptLengths`; None: not
    filtered): a GRPO checkpoint records their digest, since which prompts were kept depends on them."""

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]


def detect_schema(columns: Sequence[str]) -> str:
    """Which schema a table with these columns follows (module docstring); DataFileError if none."""
    cols = set(columns)
    if set(VERL_COLUMNS) <= cols:
        return "verl"
    if "prompt" in cols:
        return "trl"
    if "messages" in cols:
        return "messages"
    for name, required in _SCHEMA_COLUMNS.items():
        if set(required) <= cols:
            return name
    raise DataFileError(
        f"prompt data: columns {sorted(cols)} match no schema; expected geometry3k {list(_SCHEMA_COLUMNS['geometry3k'])}, "
        f"virl39k {list(_SCHEMA_COLUMNS['virl39k'])}, messages ['messages', 'answer'], verl {list(VERL_COLUMNS)} or trl "
        f"['prompt', one of {list(TRL_REFERENCE_COLUMNS)}]"
    )


# --- building prompts ------------------------------------------------------------------------------------


def _image_ref(value: Any, root: Path, row_id: str) -> Any:
    if isinstance(value, dict):  # Hugging Face Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return value["bytes"]
        value = value.get("path")
    value = local_path(value)  # "file:///data/a.png" (qwen-vl-utils) is that file
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        p = Path(value)
        if not p.is_absolute():
            p = root / p
        if not p.is_file():
            raise BadRecordError("missing_image", f"image file not found: {p}")
        return str(p)
    raise BadRecordError("invalid_record", f"unsupported image entry {type(value).__name__}")


def _user_content(text: str, images: list) -> list[dict]:
    parts = text.split(IMAGE_PLACEHOLDER)
    n_slots = len(parts) - 1
    if n_slots == 0:
        return [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text.strip()}]
    if n_slots != len(images):
        raise BadRecordError("placeholder_mismatch", f"{n_slots} {IMAGE_PLACEHOLDER} placeholders but {len(images)} images")
    content: list[dict] = []
    for k, part in enumerate(parts):
        if part.strip():
            content.append({"type": "text", "text": part.strip()})
        if k < len(images):
            content.append({"type": "image", "image": images[k]})
    return content


def _make_sample(prompt_id: str, problem: Any, answer: Any, images: list, metadata: dict, template: str,
                 system_prompt: Optional[str]) -> PromptSample:
    if not isinstance(problem, str) or not problem.replace(IMAGE_PLACEHOLDER, "").strip():
        raise BadRecordError("invalid_record", "empty question")
    if answer is None or not str(answer).strip():
        raise BadRecordError("invalid_record", "empty answer")
    rendered = template.format(problem=problem.strip())
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": _user_content(rendered, images)})
    clean = problem.replace(IMAGE_PLACEHOLDER, "").strip()
    return PromptSample(prompt_id, messages, str(answer).strip(), clean, metadata)


def _from_table_row(schema: str, cols: tuple[str, str, Optional[str]], row: dict, row_id: str, root: Path, template: str,
                    system_prompt: Optional[str]) -> PromptSample:
    q_col, a_col, img_col = cols
    raw_images = row.get(img_col) if img_col else None
    if raw_images is None:
        raw_images = []
    elif not isinstance(raw_images, (list, tuple)):
        raw_images = [raw_images]
    images = [_image_ref(v, root, row_id) for v in raw_images]
    if schema == "virl39k":
        prompt_id = str(row.get("qid") or row_id)
        metadata = {k: row[k] for k in _VIRL_META if k in row}
    else:
        prompt_id = str(row.get("id") or row_id)
        metadata = {k: v for k, v in row.items() if k not in (q_col, a_col, img_col) and isinstance(v, (str, int, float, bool))}
    return _make_sample(prompt_id, row.get(q_col), row.get(a_col), images, metadata, template, system_prompt)


def _with_row_images(msgs: list, row: dict) -> list:
    """The messages with the row's top-level "image" / "images" placed, as SFT's reader places them: at "<image>"
    text markers (ms-swift's layout) or into {"type": "image"} items without a path (TRL's), in order.
    BadRecordError "placeholder_mismatch" where images and their places are not as many (a marker without an
    image would be trained as text, an image without a place dropped)."""
    images = media_list(row, "image", "images")
    if marked_text_messages(msgs):
        if not images:
            raise BadRecordError("placeholder_mismatch", "<image> markers in the messages but no 'images' in the row")
        return place_marked_media(msgs, images=images)
    empty = [it for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list)
             for it in m["content"] if isinstance(it, dict) and it.get("type") == "image" and it.get("image") is None]
    if not images and not empty:
        return msgs
    if images:
        refuse_markers_beside_items(msgs, "image", "messages")
    if len(empty) != len(images):
        raise BadRecordError("placeholder_mismatch", f"{len(empty)} image items without a path (or <image> markers) "
                                                     f"in the messages but {len(images)} images in the row")
    queue, places = iter(images), {id(it) for it in empty}
    return [{**m, "content": [({**it, "image": next(queue)} if id(it) in places else it) for it in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in msgs]


def _image_items_read(msgs: list) -> list:
    """The messages with each image item as {"type": "image", "image": ref}: the ref read under any key SFT reads
    (`messages.image_item_ref`: transformers' "url" / "path" / "base64", a data URL), None for an item without one."""
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": [{"type": "image", "image": image_item_ref(it, f"messages[{i}].content[{j}]")}
                                  if isinstance(it, dict) and it.get("type") == "image" else it
                                  for j, it in enumerate(m["content"])]}
        out.append(m)
    return out


def _templated_question(items: list[dict], template: str) -> tuple[str, list[dict]]:
    """(problem, content) of the question turn: its text (the pieces as the chat template joins them) through
    `template`; images before all text stay in front of it, an image between text pieces (an "<image>" marker in
    the middle of the question) stays there, as SFT trains it and verl rows place it (framework_rows)."""
    lead = 0
    while lead < len(items) and items[lead]["type"] == "image":
        lead += 1
    front, rest = items[:lead], items[lead:]
    problem = "".join(it["text"] for it in rest if it["type"] == "text").strip()
    if not problem:
        raise BadRecordError("invalid_record", "empty question")
    inner = [it for it in rest if it["type"] == "image"]
    marked = "".join(_TEXT_SLOT if it["type"] == "image" else it["text"] for it in rest).strip()
    rendered = template.format(problem=marked).split(_TEXT_SLOT)
    if len(rendered) != len(inner) + 1:  # a template that repeats {problem} would repeat the images
        raise BadRecordError("placeholder_mismatch", "the prompt template repeats {problem} around images")
    out = list(front)
    for k, part in enumerate(rendered):
        if part.strip():
            out.append({"type": "text", "text": part})
        if k < len(inner):
            out.append(inner[k])
    return problem, out


def _from_messages_row(row: dict, row_id: str, root: Path, template: str, system_prompt: Optional[str]) -> PromptSample:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRecordError("invalid_record", "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRecordError("invalid_record", f"messages[{i}] must be an object, got {type(m).__name__}")
    answer = row.get("answer")
    if msgs[-1].get("role") == "assistant":
        if answer is None:
            answer = msgs[-1].get("content")
        msgs = msgs[:-1]
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if not users:
        raise BadRecordError("invalid_record", "no user turn")
    msgs = _with_row_images(_image_items_read(msgs), row)
    out: list[dict] = []
    if system_prompt and not any(m.get("role") == "system" for m in msgs):
        out.append({"role": "system", "content": system_prompt})
    problem = ""
    for i, m in enumerate(msgs):
        content = m.get("content")
        if isinstance(content, str):
            items = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            items = []
            for it in content:
                if not isinstance(it, dict) or it.get("type") not in ("text", "image"):
                    raise BadRecordError("invalid_record", f"messages[{i}]: unsupported content item {it!r:.60}")
                if it["type"] == "image":
                    items.append({"type": "image", "image": _image_ref(it.get("image"), root, row_id)})
                else:
                    items.append({"type": "text", "text": str(it.get("text", ""))})
        else:
            raise BadRecordError("invalid_record", f"messages[{i}].content must be a string or a list")
        if m.get("role") == "system" and any(it["type"] == "image" for it in items):
            raise BadRecordError("invalid_record", f"messages[{i}]: an image in the system turn")
        if i == users[-1]:
            problem, items = _templated_question(items, template)
        out.append({"role": m.get("role"), "content": items if m.get("role") != "system" else content})
    if answer is None or not str(answer).strip():
        raise BadRecordError("invalid_record", "no answer")
    # the row's images are placed in its turns (`_with_row_images`), not handed to every reward call as well
    metadata = {k: v for k, v in row.items() if k not in ("messages", "answer", "image", "images")
                and isinstance(v, (str, int, float, bool, list))}
    return PromptSample(str(row.get("id") or row_id), out, str(answer).strip(), problem, metadata)


def _from_framework_row(schema: str, row: dict, row_id: str, root: Path, template: str, system_prompt: Optional[str],
                        trl_answer: Optional[str]) -> PromptSample:
    if schema == "verl":
        messages, problem, answer, metadata = from_verl_row(row, root, row_id, template, system_prompt, _image_ref)
    else:
        assert trl_answer is not None  # found per file before the rows are read
        messages, problem, answer, metadata = from_trl_row(row, root, row_id, template, system_prompt, _image_ref, trl_answer)
    return PromptSample(str(row.get("id") or row_id), messages, answer, problem, metadata)


def _columns_from_mapping(columns: dict[str, str]) -> tuple[str, str, Optional[str]]:
    unknown = sorted(set(columns) - {"prompt", "answer", "images", "image"})
    if unknown or not {"prompt", "answer"} <= set(columns):
        raise ConfigError(
            f"columns: expected keys 'prompt', 'answer' and optionally 'images' (or 'image'), got {sorted(columns)}"
        )
    if "images" in columns and "image" in columns:
        raise ConfigError("columns: give 'images' or 'image', not both")
    return columns["prompt"], columns["answer"], columns.get("images") or columns.get("image")


def _record_keys(schema: str, columns: Optional[dict[str, str]]) -> frozenset[str]:
    """The columns of which a JSON-lines .json file's first object must have one to be prompt data (a one-line
    {"version": 2} beside the prompts is not a prompt): the mapped ones, the schema's, or any layout's."""
    if columns:
        return record_columns(columns)
    if schema in _SCHEMA_COLUMNS:
        return frozenset(_SCHEMA_COLUMNS[schema][:2])
    return {"messages": frozenset({"messages"}), "verl": frozenset({"prompt"}),
            "trl": frozenset({"prompt"})}.get(schema, RECORD_KEYS)


def _row_ids(rows: TableRows, path: str) -> dict[Path, str]:
    """The name each file contributes to row ids: its path under a folder given as `path`, else its file name."""
    if os.path.isdir(path):
        return {f: os.path.relpath(f, path) for f in rows.files}
    return {f: f.name for f in rows.files}


def load_prompt_dataset(
    path: str | os.PathLike,
    *,
    schema: Schema = "auto",
    columns: Optional[dict[str, str]] = None,
    image_root: Optional[str | os.PathLike] = None,
    prompt_template: str = "{problem}",
    system_prompt: Optional[str] = None,
    max_samples: int = 0,
    suffixes: tuple[str, ...] = HF_SUFFIXES,
    cache_dir: Optional[str] = None,
) -> PromptDataset:
    """Read prompt samples from the files at `path` through the shared data reader
    (`megatron_vlm.data.table_rows`): a .parquet / .arrow / .jsonl / .json file, a folder searched
    recursively, or a glob (`suffixes` narrows what a folder or glob yields, e.g. (".jsonl", ".json") for
    `[data] type = "messages_jsonl"`).

    `columns` maps our fields to other column names ({"prompt": ..., "answer": ..., "images": ...},
    the `[data] columns` table of type "hf"); otherwise `schema` picks a known layout ("auto" detects
    it from the column names). `image_root`: folder relative image paths resolve against (default:
    the data file's folder; for ViRL39K the release folder that holds images/). `max_samples` > 0
    keeps the first N. Rows that cannot be used are listed in `skipped` and counted in
    `bad_records` under their file and 1-based line (JSONL) / 0-based row (tables)."""
    if "{problem}" not in prompt_template:
        raise ConfigError("prompt_template: must contain the {problem} placeholder")
    rows = TableRows(path, suffixes=suffixes, cache_dir=cache_dir, record_keys=_record_keys(schema, columns))
    table_cols: Optional[tuple[str, str, Optional[str]]] = None
    if columns:
        table_cols = _columns_from_mapping(columns)
        known = [n for n, c in _SCHEMA_COLUMNS.items() if c == table_cols]
        schema = known[0] if known else "columns"  # type: ignore[assignment]
    elif schema == "auto":
        schema = detect_schema(rows.columns(rows.files[0]))  # type: ignore[assignment]
    elif schema not in SCHEMAS:
        raise ConfigError(f"schema: must be 'auto' or one of {list(SCHEMAS)}, got {schema!r}")
    if table_cols is None and schema in _SCHEMA_COLUMNS:
        table_cols = _SCHEMA_COLUMNS[schema]
    needs = [c for c in table_cols if c is not None] if table_cols else {"verl": VERL_COLUMNS, "trl": ("prompt",)}.get(schema, ())
    for file in rows.files:
        cols = set(rows.columns(file))
        missing = [c for c in needs if c not in cols]
        if missing:
            raise DataFileError(f"{file}: schema {schema!r} needs columns {missing} (has {sorted(cols)})")
    trl_answers = {str(f): trl_answer_column(rows.columns(f), f) for f in rows.files} if schema == "trl" else {}
    if trl_answers:
        logger.info("prompt data %s: TRL layout, reference answers from column(s) %s", path, sorted(set(trl_answers.values())))
    names = _row_ids(rows, os.fspath(path))
    file_order = {str(f): k for k, f in enumerate(rows.files)}
    # rows and unreadable JSON lines, in file then line / row order
    events: list[tuple[int, int, Any]] = [(file_order[f], n, err) for f, n, err in rows.errors]
    for i in range(len(rows)):
        f, n = rows.locate(i)
        events.append((file_order[f], n, i))
    events.sort(key=lambda e: e[:2])
    samples: list[PromptSample] = []
    skipped: list[tuple[str, str]] = []
    bad = BadRecordLog()
    kept_own_system = 0
    for k, index, item in events:
        file = rows.files[k]
        row_id = f"{names[file]}:{index}"
        root = Path(image_root) if image_root else file.resolve().parent
        if isinstance(item, BadRecordError):  # a line the reader could not parse
            what = f"malformed JSON ({item.detail})" if item.category == "malformed_json" else str(item)
            skipped.append((row_id, f"line {index}: {what}"))
            bad.add_error(str(file), index, item)
            continue
        try:
            row = rows.row(item)
            if schema == "messages":
                sample = _from_messages_row(row, row_id, root, prompt_template, system_prompt)
            elif schema in ("verl", "trl"):
                sample = _from_framework_row(schema, row, row_id, root, prompt_template, system_prompt,
                                             trl_answers.get(str(file)))
            else:
                assert table_cols is not None  # set above for every table schema
                sample = _from_table_row(schema, table_cols, row, row_id, root, prompt_template, system_prompt)
        except Exception as e:  # every per-row failure is a counted bad record (unexpected ones by type)
            err = unexpected(e, f"{file}:{index}")
            skipped.append((row_id, err.detail if err is e else str(err)))
            bad.add_error(str(file), index, err)
            continue
        sample.source, sample.index = str(file), index
        samples.append(sample)
        if system_prompt and _own_system_turn(sample.messages, system_prompt):
            kept_own_system += 1
        if max_samples and len(samples) >= max_samples:
            break
    if kept_own_system:
        logger.warning("prompt data %s: %d of %d rows keep their own system turn instead of rl.prompts.system_prompt "
                       "(a row's system turn wins)", path, kept_own_system, len(samples))
    if skipped:
        logger.warning("prompt data %s: skipped %d rows (first: %s: %s)", path, len(skipped), *skipped[0])
    if not samples:
        raise DataFileError(f"prompt data {path}: no usable rows ({len(skipped)} skipped; first reason: {skipped[0][1] if skipped else 'empty'})")
    return PromptDataset(samples, schema, skipped, bad, files=list(rows.files))


def _own_system_turn(messages: list[dict], system_prompt: str) -> bool:
    """Whether a prompt's system turn is the row's own, not `rl.prompts.system_prompt` (which a row's own wins over)."""
    return bool(messages) and messages[0].get("role") == "system" and messages[0].get("content") != system_prompt


def prompt_batches(num_samples: int, prompts_per_step: int, *, seed: int, start_step: int = 0) -> Iterator[list[int]]:
    """Endless deterministic stream of index batches for GRPO steps start_step, start_step + 1, ...

    Each epoch is a fresh permutation (seeded by seed and the epoch); a step takes the next
    `prompts_per_step` indices and runs over epoch boundaries. Step s always gets the same batch
    for the same seed, so a resumed run continues the data order exactly."""
    if num_samples < 1 or prompts_per_step < 1:
        raise ValueError(f"prompt_batches: need num_samples >= 1 and prompts_per_step >= 1, got {num_samples}, {prompts_per_step}")
    perms: dict[int, list[int]] = {}

    def perm(epoch: int) -> list[int]:
        if epoch not in perms:
            order = list(range(num_samples))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            perms.clear()
            perms[epoch] = order
        return perms[epoch]

    step = start_step
    while True:
        start = step * prompts_per_step
        batch = []
        for pos in range(start, start + prompts_per_step):
            epoch, k = divmod(pos, num_samples)
            batch.append(perm(epoch)[k])
        yield batch
        step += 1
