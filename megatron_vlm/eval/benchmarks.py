"""Benchmark files as evaluation records: column adapters for the public releases, read locally.

A benchmark row becomes a `Record` (data/messages.py) with one user turn — the row's images, then
the prompt text — and the reference answer as the last assistant turn, so the data pipeline's eval
loader (`build_eval_dataloader(..., source=...)`) encodes it exactly as it encodes an SFT held-out
prompt. The prompt text is `prompt_template.format(problem=...)`, where the problem is the question
with its image placeholders (`<image>`, `<image1>`, `<image 1>`) removed — the images are placed
before the text — and, for formats that keep the options apart from the question, the options as
lines "A. ...".

mmmu is the exception: its options can be images (["<image 2>", "<image 3>", ...]) and its questions say
which picture they mean ("In <image 2>, ..."), so with every image first and the markers removed the
model could not tell which picture option A is. There each "<image k>" of the question and the options
is replaced by image k itself, in place (the user turn is text and image items in the order of the
formatted prompt: "Q: ", image 1, " Which ...?\\nA. ", image 2, "\\nB. ", image 3, ...), as VLMEvalKit
(the OpenCompass leaderboard's toolkit) and lmms-eval's interleaved mode build the prompt; MMMU's own
evaluation code gives single-image models image_1 only, with the markers left as text. An image named
twice is given at each marker, as both interleaving references do; an image no marker names stays
before the text, in column order; a marker naming an empty or missing image column makes the row a bad
record (the question would point at nothing). The metadata's problem keeps the markers as written.

The record's metadata carries what the verifiers need: `answer`, `problem`,
`choices` (option texts, lettered in order), `verifier` (which scorer this row uses), `id`, a
`question_type` column when the release has one (MathVista, MMMU: per-type accuracy), and `precision`
(MathVista: the decimal places a float answer is rounded to before the math verifier compares it, as the
official scorer does; rows whose `answer_type` is not "float" have none).

Formats and the columns they expect (`[[eval.benchmarks]] columns` renames any of them; question,
answer and a given images column must exist, choices, id and precision are used when present):

    format      question   answer   images                       choices            id    verifier (auto)
    geometry3k  problem    answer   images (list)                -                  -     math
    mathvista   query      answer   decoded_image                choices (list)     pid   choice if choices else math
    mathvision  question   answer   decoded_image                options (list)     id    choice if options else math
    logicvista  question   answer   image                        -                  -     choice (options in the question)
    mmmu        question   answer   image_1 ... image_7          options            id    choice if options else math
    columns     (all from `columns`)                                                      choice if choices else math
    messages    a messages JSONL record (the last assistant turn is the answer)           short_answer

- geometry3k: hiyouga/geometry3k (test split): `images` a list of Image structs, `problem` with
  "<image>" markers, `answer` a LaTeX expression.
- mathvista: AI4Math/MathVista testmini: `query` is the official prompt (hint, question and the
  "Choices:" lines already in it, so options are not appended again), `decoded_image` the Image,
  `choices` the option texts of multi-choice rows (null for free-form), `answer` the option text
  or the number, `pid` the id, `precision` the decimal places of an `answer_type` "float" answer (1.46
  is right for 1.5 at one place: 1.5 once rounded; a precision that is not a whole number of places in
  [0, 15] makes the row a bad record).
- mathvision: MathLLMs/MathVision (test / testmini): `question` with "<image1>" markers, `options`
  a list (empty for free-form rows), `answer` a letter or a value, `decoded_image` the Image.
- logicvista: LogicVista: `question` with its lettered options in the text, `answer` the letter,
  `image` the Image.
- mmmu: MMMU-style multiple choice: `question` with "<image 1>" markers, `options` the option
  texts as a list or as the Python-literal string the MMMU release stores ("['a', 'b']", read with
  `ast.literal_eval`, which accepts literals only; an option may be only a marker, "<image 2>"),
  `image_1` ... `image_7` (null when unused; with `columns.images` one list column, whose k-th entry
  is "<image k>"), `answer` the letter (open questions: the value). Images go at their markers (above).

An image is an Image struct ({"bytes", "path"}), raw bytes or a path (relative paths resolve
against `image_root`, else the data file's folder). A row without a question or answer, with
options or a precision it cannot read, or whose answer has nothing left once its verifier normalises it ("." , "$$":
an empty generation would match it) is a bad record (counted by file and row, never fatal).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.data_files import (
    HF_SUFFIXES,
    MESSAGES_RECORD_KEYS,
    MESSAGES_SUFFIXES,
    DataFileError,
    data_path_errors,
    find_data_files,
)
from megatron_vlm.data.messages import Record, read_messages_jsonl, resolve_path
from megatron_vlm.data.processing import prompt_messages
from megatron_vlm.data.sources import ListRecords
from megatron_vlm.data.table_rows import TableRows
from megatron_vlm.eval.answers import reference_is_empty
from megatron_vlm.rl.rewards.verifiers import answer_precision

__all__ = ["BenchmarkFormat", "FORMATS", "BenchmarkRecords", "OpenedBenchmark", "open_benchmark", "benchmark_record",
           "format_options"]

OPTION_LETTERS = "ABCDEFGHIJ"
_PLACEHOLDER = re.compile(r"<image\s*\d*>", re.IGNORECASE)
_NUMBERED = re.compile(r"<image\s*(\d+)>", re.IGNORECASE)
_SLOT = re.compile("\x00(\\d+)\x00")  # where image k goes in the formatted prompt (no text holds a NUL: removed)
_MAX_OPTIONS_CHARS = 100_000


@dataclass(frozen=True)
class BenchmarkFormat:
    columns: dict[str, str]
    """Our field -> the release's column (question, answer, choices, id)."""
    image_columns: tuple[str, ...] = ()
    """Columns holding images (each one image, a list of images or null), in prompt order."""
    append_options: bool = True
    """Write the options under the question ("A. ..."); false when the question text has them."""
    free_verifier: str = "math"
    """The "auto" verifier of rows without options."""
    choice_verifier: str = "choice"
    """The "auto" verifier of rows with options."""
    images_at_markers: bool = False
    """Put image k where the question or an option names it ("<image 2>"), not before the text (MMMU: its options
    can be images, and its questions say which picture they mean)."""


FORMATS: dict[str, BenchmarkFormat] = {
    "geometry3k": BenchmarkFormat({"question": "problem", "answer": "answer"}, ("images",)),
    "mathvista": BenchmarkFormat({"question": "query", "answer": "answer", "choices": "choices", "id": "pid",
                                  "precision": "precision"},
                                 ("decoded_image",), append_options=False),
    "mathvision": BenchmarkFormat({"question": "question", "answer": "answer", "choices": "options", "id": "id"},
                                  ("decoded_image",)),
    "logicvista": BenchmarkFormat({"question": "question", "answer": "answer"}, ("image",), free_verifier="choice"),
    "mmmu": BenchmarkFormat({"question": "question", "answer": "answer", "choices": "options", "id": "id"},
                            tuple(f"image_{k}" for k in range(1, 8)), images_at_markers=True),
    "columns": BenchmarkFormat({}),
}


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _image_ref(value: Any, root: Path) -> Any:
    if isinstance(value, dict):  # an Image feature's {"bytes", "path"} struct
        if value.get("bytes"):
            return {"bytes": value["bytes"], "path": value.get("path")}
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        return resolve_path(value, root)
    raise BadRecordError("invalid_record", f"unsupported image entry {type(value).__name__}")


def _options(value: Any, column: str) -> list[str]:
    """Option texts from a list or from the Python-literal string of a list (MMMU)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if len(text) > _MAX_OPTIONS_CHARS:
            raise BadRecordError("invalid_record", f"column {column!r}: options longer than {_MAX_OPTIONS_CHARS} characters")
        try:
            value = ast.literal_eval(text)  # literals only: no names, calls or attributes are evaluated
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise BadRecordError("invalid_record", f"column {column!r}: options are not a list literal: {text[:60]!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, int, float)) for v in value):
        raise BadRecordError("invalid_record", f"column {column!r}: expected a list of option texts")
    if len(value) > len(OPTION_LETTERS):
        raise BadRecordError("invalid_record", f"column {column!r}: {len(value)} options, at most {len(OPTION_LETTERS)}")
    return [str(v) for v in value]


def format_options(choices: list[str]) -> str:
    return "\n".join(f"{OPTION_LETTERS[i]}. {c}" for i, c in enumerate(choices))


def _refuse_empty_reference(answer: str, verifier: str, what: str) -> None:
    """A reference with nothing left once its verifier normalises it ("." , "$$") is a bad record: an empty
    generation normalises alike, and no answer of the model could be right or wrong against it."""
    if reference_is_empty(answer, verifier):
        raise BadRecordError("invalid_record", f"{what} {answer[:40]!r} has nothing left once the {verifier} verifier "
                                               "normalises it")


def benchmark_record(row: dict, fmt: BenchmarkFormat, columns: dict[str, str], *, verifier: str, template: str,
                     system_prompt: Optional[str], root: Path, source: str, index: int) -> Record:
    """The evaluation `Record` of one benchmark row (module docstring)."""
    question, answer = row.get(columns["question"]), row.get(columns["answer"])
    if not isinstance(question, str) or not _PLACEHOLDER.sub("", question).strip():
        raise BadRecordError("invalid_record", f"column {columns['question']!r}: empty or not text")
    if answer is None or not str(answer).strip():
        raise BadRecordError("invalid_record", f"column {columns['answer']!r} is empty")
    answer = str(answer).strip()
    choices = _options(row.get(columns["choices"]), columns["choices"]) if "choices" in columns else []
    if verifier == "auto":
        verifier = fmt.choice_verifier if choices else fmt.free_verifier
    _refuse_empty_reference(answer, verifier, columns["answer"])
    image_cols = (columns["images"],) if "images" in columns else fmt.image_columns
    if fmt.images_at_markers:
        problem, content = _images_at_markers(row, question, choices if fmt.append_options else [], image_cols,
                                              template, root)
    else:
        problem = _PLACEHOLDER.sub("", question).strip()
        if choices and fmt.append_options:
            problem = f"{problem}\n{format_options(choices)}"
        images = [_image_ref(v, root) for col in image_cols for v in _as_list(row.get(col))]
        content = [{"type": "image", "image": im} for im in images]
        content.append({"type": "text", "text": template.format(problem=problem)})
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    meta: dict[str, Any] = {"answer": answer, "problem": problem, "verifier": verifier}
    if choices:
        meta["choices"] = choices
    if "id" in columns and row.get(columns["id"]) is not None:
        meta["id"] = str(row[columns["id"]])
    if isinstance(row.get("question_type"), str):  # MathVista / MMMU: per-type accuracy in the results
        meta["question_type"] = row["question_type"]
    precision = _precision(row, columns)
    if precision is not None:
        meta["precision"] = precision
    return Record(messages, source, index, meta)


def _numbered_images(row: dict, image_cols: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(where, value) of image 1, 2, ...: one per column (MMMU's image_1 ... image_7, null when unused), or the
    entries of a single images column (`columns.images`)."""
    if len(image_cols) == 1:
        return [(f"{image_cols[0]}[{k}]", v) for k, v in enumerate(_as_list(row.get(image_cols[0])))]
    return [(col, row.get(col)) for col in image_cols]


def _images_at_markers(row: dict, question: str, choices: list[str], image_cols: tuple[str, ...], template: str,
                       root: Path) -> tuple[str, list[dict]]:
    """(problem, user-turn content) of a row whose text names its images: the prompt with image k in place of each
    "<image k>" of the question and the options (named twice: given twice, as VLMEvalKit and lmms-eval's
    interleaved mode give it), the images no marker names first, in column order. The problem keeps the markers."""
    numbered = _numbered_images(row, image_cols)
    problem = _PLACEHOLDER.sub(lambda m: m.group(0) if _NUMBERED.fullmatch(m.group(0)) else "", question).strip()
    if choices:
        problem = f"{problem}\n{format_options(choices)}"
    problem = problem.replace("\x00", "")
    named: set[int] = set()

    def slot(m: re.Match) -> str:
        k = int(m.group(1))
        if not 1 <= k <= len(numbered) or numbered[k - 1][1] is None:
            where = f"{numbered[k - 1][0]} is empty" if 1 <= k <= len(numbered) else f"it has {len(numbered)} images"
            raise BadRecordError("invalid_record", f"the text names {m.group(0)!r}, but the row has no such image "
                                                   f"({where})")
        named.add(k)
        return f"\x00{k}\x00"

    parts = _SLOT.split(template.format(problem=_NUMBERED.sub(slot, problem)))
    content: list[dict] = [{"type": "image", "image": _image_ref(v, root)}
                           for k, (_, value) in enumerate(numbered, 1) if k not in named for v in _as_list(value)]
    refs = {k: _image_ref(numbered[k - 1][1], root) for k in sorted(named)}
    for j, part in enumerate(parts):
        if j % 2:
            content.append({"type": "image", "image": refs[int(part)]})
        elif part:
            content.append({"type": "text", "text": part})
    return problem, content


def _precision(row: dict, columns: dict[str, str]) -> Optional[int]:
    """The decimal places a float answer is rounded to before it is compared (MathVista's `precision`, a float64
    column that is null for the other rows; read only for an `answer_type` of "float" when the row has one)."""
    if "precision" not in columns or row.get("answer_type", "float") != "float":
        return None
    try:
        return answer_precision(row.get(columns["precision"]))
    except ValueError as e:
        raise BadRecordError("invalid_record", f"column {columns['precision']!r}: {e}") from None


def _up_to(bad: BadRecordLog, files: list, last: tuple[str, int]) -> BadRecordLog:
    """The bad records of `bad` at or before `last` (file, line / row) in the files' order: those of the rows that
    `max_samples` keeps. Malformed lines are found when the files are opened, before the rows are cut, and one
    past the last kept row was counted for a benchmark that never reached it."""
    order = {str(f): k for k, f in enumerate(files)}
    cut = (order[str(last[0])], last[1])
    out = BadRecordLog()
    out.extend(r for r in bad.to_dict()["records"] if (order.get(r["source"], len(order)), r["index"]) <= cut)
    return out


class BenchmarkRecords:
    """The rows of one benchmark's files as records (a data-pipeline record source: `get`, `locate`)."""

    def __init__(self, cfg: BenchmarkConfig, *, template: str, system_prompt: Optional[str] = None):
        self.name = cfg.path
        self.fmt = FORMATS[cfg.format]
        self.columns = {**self.fmt.columns, **cfg.columns}
        self.verifier, self.template, self.system_prompt = cfg.verifier, template, system_prompt
        self.image_root = Path(cfg.image_root) if cfg.image_root else None
        self.bad_records = BadRecordLog()
        self.rows = TableRows(cfg.path, suffixes=HF_SUFFIXES, bad_records=self.bad_records,
                              record_keys={self.columns[k] for k in ("question", "answer") if k in self.columns})
        image_cols = (self.columns["images"],) if "images" in self.columns else ()
        for file in self.rows.files:
            have = set(self.rows.columns(file))
            required = [self.columns[k] for k in ("question", "answer", "images") if k in self.columns]
            missing = sorted(c for c in required if c not in have)  # choices / id: used when present
            if have and missing:
                raise DataFileError(f"{file} has no column(s) {missing} for format "
                                 f"{cfg.format!r} (has {sorted(have)}); rename them with `columns`")
            if have and not image_cols and self.fmt.image_columns and not have & set(self.fmt.image_columns):
                raise DataFileError(f"{file} has none of the image columns "
                                 f"{list(self.fmt.image_columns)} of format {cfg.format!r}; name one with columns.images")
        self._n = min(len(self.rows), cfg.max_samples) if cfg.max_samples else len(self.rows)
        if self._n < len(self.rows):
            self.bad_records = _up_to(self.bad_records, self.rows.files, self.rows.locate(self._n - 1))

    def __len__(self) -> int:
        return self._n

    def locate(self, i: int) -> tuple[str, int]:
        return self.rows.locate(i)

    def identity(self) -> dict:
        """What the records depend on (the length cache's key, a kept eval result's fingerprint): files, mapping,
        prompt, count, and for mmmu the images-at-markers layout (a cache made when every image went first differs)."""
        out = {"files": self.rows.identity(), "columns": self.columns, "template": self.template,
               "system": self.system_prompt, "verifier": self.verifier, "n": self._n,
               "image_root": str(self.image_root.resolve()) if self.image_root else None}
        if self.fmt.images_at_markers:  # a length cache or kept result of the images-first layout is not for these
            out["images_at_markers"] = True
        return out

    def get(self, i: int) -> Record:
        source, index = self.rows.locate(i)
        root = self.image_root or Path(source).resolve().parent
        return benchmark_record(self.rows.row(i), self.fmt, self.columns, verifier=self.verifier, template=self.template,
                                system_prompt=self.system_prompt, root=root, source=source, index=index)


@dataclass
class OpenedBenchmark:
    source: Any
    """The record source (`BenchmarkRecords`, or `ListRecords` for messages JSONL)."""
    bad_records: BadRecordLog = field(default_factory=BadRecordLog)
    """Rows left out while opening (malformed JSON lines); per-row problems are added by the loader."""


def _text_of(content: Any) -> str:
    """The text of a turn's content (a string, or its text items joined as the chat templates write them)."""
    if isinstance(content, str):
        return content.strip()
    return "".join(it["text"] for it in content if it.get("type") == "text").strip()


def _templated(template: str, content: Any) -> Any:
    """A user turn's content with `template` applied to its text once: a turn of several text items (text around
    its images) gets the template's text before {problem} ahead of its first item and the text after it behind its
    last, where `template.format(problem=<the turn's text>)` puts them (applied to each item, the instruction was
    repeated once per item)."""
    if isinstance(content, str):
        return template.format(problem=content)
    texts = [k for k, it in enumerate(content) if it["type"] == "text"]
    if len(texts) <= 1:
        return [dict(it, text=template.format(problem=it["text"])) if it["type"] == "text" else it for it in content]
    marker = "\x00"
    head, _, tail = template.format(problem=marker).partition(marker)
    tail = tail.replace(marker, "".join(content[k]["text"] for k in texts))  # a template that repeats {problem}
    out = [dict(it) for it in content]
    out[texts[0]]["text"] = head + out[texts[0]]["text"]
    out[texts[-1]]["text"] = out[texts[-1]]["text"] + tail
    return out


def _messages_source(cfg: BenchmarkConfig, template: str, system_prompt: Optional[str]) -> OpenedBenchmark:
    bad = BadRecordLog()
    records = read_messages_jsonl(cfg.path, image_root=cfg.image_root or None, bad_records=bad)
    verifier = "short_answer" if cfg.verifier == "auto" else cfg.verifier
    out = []
    if cfg.max_samples and len(records) > cfg.max_samples:
        last = records[cfg.max_samples - 1]
        bad = _up_to(bad, find_data_files(cfg.path, MESSAGES_SUFFIXES, MESSAGES_RECORD_KEYS), (last.source, last.index))
    for r in records[: cfg.max_samples or None]:
        messages = [dict(m) for m in r.messages]
        if any(m["role"] == "assistant" for m in messages):  # none: refused by the loader, as in an SFT eval split
            try:
                _refuse_empty_reference(str(prompt_messages(messages)[1]), verifier, "the last assistant turn")
            except BadRecordError as e:
                bad.add_error(r.source, r.index, e)
                continue
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        # the question (the last user turn's text) is the verifiers' prompt, as a messages prompt's is in training:
        # the choice verifier reads the options from it
        meta = {"problem": _text_of(messages[users[-1]]["content"])} if users else {}
        if template != "{problem}" and users:  # the template applies to the text of the last user turn
            messages[users[-1]]["content"] = _templated(template, messages[users[-1]]["content"])
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        out.append(Record(messages, r.source, r.index, {**meta, **r.meta, "verifier": verifier}))
    root = str(Path(cfg.image_root).resolve()) if cfg.image_root else None
    return OpenedBenchmark(ListRecords(cfg.path, out, find_data_files(cfg.path, MESSAGES_SUFFIXES, MESSAGES_RECORD_KEYS), image_root=root), bad)


def open_benchmark(cfg: BenchmarkConfig, *, template: str, system_prompt: Optional[str] = None,
                   key: str = "eval.benchmarks.path") -> OpenedBenchmark:
    """The record source of one `[[eval.benchmarks]]` table. No files at its path, a table that does not
    open, or columns that do not fit the format: ConfigError starting with `key` (the caller's
    "eval.benchmarks[i].path"; exit 2)."""
    with data_path_errors(key):
        if cfg.format == "messages":
            return _messages_source(cfg, template, system_prompt)
        src = BenchmarkRecords(cfg, template=template, system_prompt=system_prompt)
    return OpenedBenchmark(src, src.bad_records)

