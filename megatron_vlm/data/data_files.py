"""Which files a `[data]` path names: one file, a folder searched recursively, or a glob.

SFT and GRPO both resolve `train_path` / `eval_path` here, so they read the same files in the
same order (sorted by their full path). A folder's hidden files and the files inside its hidden folders
(".ipynb_checkpoints": Jupyter's autosaved copies of the data beside it) or "__" folders ("__pycache__") are not
data, as Hugging Face `datasets` searches a data folder (a glob leaves hidden names out by itself; a file named
directly is read). The suffixes depend on `[data] type`: "hf" reads
.parquet, .arrow, .jsonl and .json files, "messages_jsonl" reads .jsonl and .json files. A file
named directly is taken whatever its suffix and content (one that holds a single JSON array of
records, as LLaVA's .json files do, is read element by element: table_rows.py).

A .json file found in a folder or by a glob is data when its content is, as table_rows reads it: one
JSON array (its first non-blank byte is "[") or JSON lines of records: its first non-blank line is a JSON
object on its own (at most 16 MiB: a longer one-line object, such as COCO's instances_*.json, is not read
whole; a file of one pretty-printed object counts as that object on one line, `one_json_object`) that has one
of the columns the dataset reads (`record_keys`: "messages" / "conversations" / "completion" for messages records,
the mapped columns of `[data] columns`; `record_columns`). Next to data, .json files are
often not data: `save_to_disk` writes dataset_info.json and state.json (pretty-printed objects) beside its
.arrow files and a one-line dataset_dict.json above a DatasetDict's splits; a model folder has config.json,
a data folder an info.json. Those names (`METADATA_JSON`) are never JSON-lines data, and any other
one-object file fails the content test unless it is shaped like a record: a one-line {"messages": [...]}
file is one row, as Hugging Face `datasets` reads it, but a one-line {"version": 2} is not a row without a
conversation (it used to be one: a bad record of a messages split, and a whole "hf" split refused for the
columns it lacks). The files skipped are counted in one log line (a warning when a skipped file has another
name: it may be data in a layout not read here, such as {"data": [...]}), and named in the "no data files"
error when nothing else is there. The line is written once per process and path, by rank 0 (every rank lists
the same files, some callers list them twice). A .jsonl file is always data: each line a row.

A path that cannot be read as a whole — no data files there, a table file that does not open (a
truncated or mislabelled .parquet), a file without the columns the mapping needs — is not a bad
record to skip but a setting to fix: `FileNotFoundError` / `DataFileError` here, turned into a
`ConfigError` naming the config key (exit 2, one line) by `data_path_errors(key)` where the key is
known (the SFT and GRPO splits, the eval benchmarks). Before, they ended the job with a traceback
and exit 1.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from megatron_vlm.errors import ConfigError

__all__ = ["TABLE_SUFFIXES", "HF_SUFFIXES", "MESSAGES_SUFFIXES", "METADATA_JSON", "MESSAGES_RECORD_KEYS", "RECORD_KEYS",
           "DataFileError", "data_path_errors", "record_columns", "find_data_files", "content_signatures",
           "changed_data_file", "keep_files_hint", "source_files", "one_json_object"]

TABLE_SUFFIXES = (".parquet", ".arrow")
"""Columnar files (read as tables); every other file is read as JSON lines."""
HF_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")
MESSAGES_SUFFIXES = (".jsonl", ".json")
METADATA_JSON = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json", "config.json"})
"""Names of .json files that describe a dataset or model rather than hold records (see the module docstring)."""
MESSAGES_RECORD_KEYS = frozenset({"messages", "conversations", "completion"})
"""The keys a messages record is built from (data/messages.py; "completion": TRL's prompt-completion rows): a
JSON-lines .json file whose first object has none of them is not messages data."""
RECORD_KEYS = frozenset({"messages", "conversations", "prompt", "problem", "question", "chosen", "rejected"})
"""The record columns of every layout read here (messages, LLaVA / ShareGPT, prompt / answer, Geometry3K, ViRL39K,
verl / TRL prompts, preference pairs): the `record_keys` of a reader that detects its layout from the files."""


def record_columns(columns: Mapping[str, str]) -> frozenset[str]:
    """The columns a record needs under a column mapping (our field -> column): the conversation, prompt, question,
    answer or preference columns it names (all its columns when it names none of those). A JSON-lines .json file
    in a folder whose first object has none of them is not data (module docstring)."""
    needed = frozenset(columns[k] for k in ("messages", "prompt", "question", "answer", "chosen", "rejected")
                       if k in columns)
    return needed or frozenset(columns.values())

log = logging.getLogger("megatron_vlm")


def file_signature(path: Path) -> dict:
    """A file's resolved path, size and modification time: what a cache keyed on the file compares."""
    st = path.stat()
    return {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


CONTENT_WINDOW = 1 << 20
"""Bytes read at each end of a data file for its content digest (fewer for a split of many files)."""
_CONTENT_BUDGET = 128 << 20
"""Bytes a split's digests read at most in all (the window shrinks for more than 64 files, to 64 KiB)."""


def _content_digest(path: Path, size: int, window: int) -> str:
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= 2 * window:
            h.update(f.read())
        else:
            h.update(f.read(window))
            f.seek(size - window)
            h.update(f.read(window))
    return h.hexdigest()


def content_signatures(files: list[Path]) -> dict:
    """What a checkpoint's data position was read from: each file's path, size and a SHA-256 of its first and last
    `window` bytes (the whole file when smaller), in reading order.

    Why content and not the modification time: a record count, a size and an mtime all survive replacing a file
    by another of the same length (or a copy that keeps the mtime), and a copy of the same data to another folder
    changes the path and mtime but not what the position points at. Reading two windows per file keeps it cheap
    for large files; an edit strictly inside a file larger than two windows, keeping its size, is not seen."""
    window = max(64 << 10, min(CONTENT_WINDOW, _CONTENT_BUDGET // max(1, 2 * len(files))))
    out = []
    for f in files:
        size = f.stat().st_size
        out.append({"file": str(f.resolve()), "size": size, "sha256": _content_digest(f, size, window)})
    return {"window": window, "files": out}


def source_files(source: object) -> list[Path]:
    """The files a record source reads, in order: its `files`, or those of the source it wraps (`rows`, `records`,
    `pairs`); [] for records held in memory."""
    files = getattr(source, "files", None)
    if files is not None:
        return [Path(f) for f in files]
    for inner in ("rows", "records", "pairs"):
        if hasattr(source, inner):
            return source_files(getattr(source, inner))
    return []


def _shown(paths: list[str], root: str) -> str:
    names = [os.path.relpath(p, root) if root else p for p in paths]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _set_change(old: list[dict], new: list[dict], same_window: bool) -> str:
    """What a different number of files read means: the files only this run reads, those only the checkpoint read
    (matched by content, so a copy of the data elsewhere counts as the same files), and where they are .json files,
    the rule that decides which are read."""
    def ident(e: dict) -> tuple:
        return (e.get("size"), e.get("sha256")) if same_window else (os.path.basename(str(e.get("file"))), e.get("size"))

    old_ids, new_ids = {ident(e) for e in old}, {ident(e) for e in new}
    added = [str(e["file"]) for e in new if ident(e) not in old_ids]
    dropped = [str(e.get("file")) for e in old if ident(e) not in new_ids]
    everything = [str(e.get("file")) for e in [*old, *new]]
    root = os.path.commonpath(everything) if everything and all(os.path.isabs(f) for f in everything) else ""
    if root in everything:  # one file: named by its full path
        root = os.path.dirname(root)
    parts = [f"the checkpoint was written reading {len(old)} data files, this run reads {len(new)}"]
    if added:
        parts.append(f"this run also reads {_shown(added, root)}")
    if dropped:
        parts.append(f"the checkpoint also read {_shown(dropped, root)}, which this run does not")
    text = parts[0] + (": " + "; ".join(parts[1:]) if len(parts) > 1 else "")
    if any(f.endswith(".json") for f in added + dropped):
        text += (" (a .json file in a folder or glob is read when it holds one JSON array, or JSON lines whose first "
                 "object has a record column, and is skipped as not data otherwise, named in the log's \"skipped as "
                 "not data\" line; earlier versions read .json files in folders by other rules)")
    return text


def changed_data_file(saved: object, now: object) -> str | None:
    """None when the checkpoint's `content_signatures` (`saved`) match this run's (`now`), or when either is missing
    (a checkpoint written before they were recorded; a source without files); else what differs, naming the file
    (for another number of files, each file only one side reads)."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return None
    old, new = list(saved.get("files") or ()), list(now.get("files") or ())
    same_window = saved.get("window") == now.get("window")  # digests over another window: the sizes alone
    if len(old) != len(new):
        return _set_change(old, new, same_window)
    for a, b in zip(old, new):
        if a.get("size") == b["size"] and (a.get("sha256") == b["sha256"] or not same_window):
            continue
        was = f" (the checkpoint's was {a.get('file')})" if a.get("file") != b["file"] else ""
        how = ("other content of the same size" if a.get("size") == b["size"]
               else f"{b['size']} bytes, the checkpoint's {a.get('size')}")
        return f"{b['file']} is not the file the checkpoint was written reading{was}: {how}"
    return None


def keep_files_hint(saved: object, now: object, key: str) -> str | None:
    """'Set <key> = "<folder>/**/*<suffix>"' when that glob reads exactly the checkpoint's files where this run reads
    more (they all have one suffix, e.g. .jsonl, and this run adds files of others, e.g. .json files it reads in
    the folder now); None otherwise."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return None
    old = [str(e.get("file")) for e in saved.get("files") or ()]
    new = [str(e.get("file")) for e in now.get("files") or ()]
    suffixes = {Path(f).suffix for f in old}
    if not old or len(suffixes) != 1 or not all(os.path.isabs(f) for f in old + new):
        return None
    suffix = suffixes.pop()
    root = os.path.commonpath(old + new)
    if root in old + new:
        root = os.path.dirname(root)
    pattern = f"{root}/**/*{suffix}"
    if len(new) == len(old) or sorted(f for f in new if f.endswith(suffix)) != sorted(old):
        return None
    if sorted(str(Path(f).resolve()) for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)) != sorted(old):
        return None  # the glob would read other files too (the data path was a narrower glob)
    return f'Set {key} = "{pattern}"'


_PEEK = 1 << 16
"""Bytes of a line read to see how a .json file found in a folder or glob starts."""
_FIRST_LINE_LIMIT = 16 << 20
"""The longest first line read to decide that a .json file starting with "{" is JSON lines; a longer one (a
one-line annotation object such as COCO's instances_*.json) is skipped as not data."""


def one_json_object(path: Path) -> Optional[str]:
    """The text of a file that is one JSON object written over several lines (pretty-printed, as `json.dump(...,
    indent=2)` writes it), or None: JSON lines, an array, not JSON, or over `_FIRST_LINE_LIMIT` bytes.

    Why: read as JSON lines, such a file is one bad record per line; it is the same record as the object written on
    one line, and is read as that (one row; in a folder or glob, data when it has a column the dataset reads).
    Only a file whose first non-blank line opens an object that does not end on it is parsed whole."""
    try:
        with path.open("rb") as f:
            line = f.readline(_PEEK).removeprefix(b"\xef\xbb\xbf")
            while line and not line.strip():
                line = f.readline(_PEEK)
            if not line.lstrip().startswith(b"{") or not line.endswith(b"\n") or _parses(line):
                return None
            if path.stat().st_size > _FIRST_LINE_LIMIT:
                return None
            f.seek(0)
            text = f.read().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        return text if isinstance(json.loads(text), dict) else None
    except (ValueError, RecursionError):
        return None


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


def _json_holds_records(path: Path, record_keys: Collection[str]) -> bool:
    """Whether a .json file found in a folder or by a glob is data: one JSON array, or JSON lines whose first object
    has one of `record_keys` (not a metadata name). Only the start of the first non-blank line is read for an array
    (json.dump writes one on one line: the whole file), that line (up to `_FIRST_LINE_LIMIT`) for JSON lines."""
    try:
        with path.open("rb") as f:
            line = f.readline(_PEEK).removeprefix(b"\xef\xbb\xbf")
            while line and not line.strip():
                line = f.readline(_PEEK)
            head = line.lstrip()
            if head.startswith(b"["):
                return True
            if path.name in METADATA_JSON or not head.startswith(b"{"):
                return False
            if not line.endswith(b"\n"):
                line += f.readline(_FIRST_LINE_LIMIT)
                if not line.endswith(b"\n") and f.read(1):
                    return False
    except OSError:  # unreadable: skipped with the others, named in the warning
        return False
    whole = one_json_object(path)  # one pretty-printed object: tested as the same object on one line would be
    try:
        first = json.loads(line if whole is None else whole)
    except (ValueError, RecursionError):  # not valid JSON, not UTF-8, nested too deeply: not a JSON object line
        return False
    return isinstance(first, dict) and any(k in first for k in record_keys)


_reported: set[tuple[str, tuple[str, ...]]] = set()
"""(path, files skipped) this process has logged."""


def _first_report(text: str, skipped: list[str]) -> bool:
    """Whether to log the skipped files of `text`: on the launcher's rank 0 (RANK; unset: one process), the first time
    this process finds them there. Every rank lists the same folder, an eval benchmark's files are listed twice (checked
    before the model is built, then read), and a path is listed again at each resume check: the same line each time."""
    try:
        if int(os.environ.get("RANK") or 0) != 0:
            return False
    except ValueError:
        pass
    key = (os.path.abspath(text), tuple(skipped))
    if key in _reported:
        return False
    _reported.add(key)
    return True


def _hidden(rel: Path) -> bool:
    """Whether a file found under a data folder (`rel`: its path below the folder) is left out, as Hugging Face
    `datasets` leaves it out of a data folder: a hidden file, or one inside a hidden folder (".ipynb_checkpoints":
    Jupyter's autosaved copies of the data) or a "__" folder ("__pycache__")."""
    *folders, name = rel.parts
    return name.startswith(".") or any(d.startswith((".", "__")) for d in folders)


def find_data_files(path: str | os.PathLike, suffixes: tuple[str, ...] = HF_SUFFIXES,
                    record_keys: Collection[str] = RECORD_KEYS) -> list[Path]:
    """The data files at `path` (see module docstring); FileNotFoundError when there are none. `record_keys`: the
    columns of which a JSON-lines .json file's first object must have one to be data (`record_columns`; none given:
    those of every layout, `RECORD_KEYS`)."""
    record_keys = record_keys or RECORD_KEYS
    text = os.fspath(path)
    kinds = " / ".join(suffixes)
    if os.path.isdir(text):
        found = [str(p) for p in Path(text).rglob("*")
                 if p.suffix in suffixes and not _hidden(p.relative_to(text)) and p.is_file()]
    elif any(ch in text for ch in "*?["):
        found = [f for f in glob.glob(text, recursive=True) if Path(f).suffix in suffixes and os.path.isfile(f)]
    elif os.path.isfile(text):
        return [Path(text)]  # named directly: whatever its suffix and content
    else:
        raise FileNotFoundError(f"no {kinds} data files at {text!r}")
    names = [f for f in found if Path(f).suffix != ".json" or _json_holds_records(Path(f), record_keys)]
    skipped = sorted(set(found) - set(names))
    about = ""
    if skipped:
        shown = ", ".join(os.path.relpath(f, text) if os.path.isdir(text) else f for f in skipped[:8])
        about = f"{len(skipped)} .json files skipped as not data: {shown}{', ...' if len(skipped) > 8 else ''}"
        unknown = [f for f in skipped if Path(f).name not in METADATA_JSON]
        why = (f"{len(unknown)} of them neither one JSON array nor JSON lines of records, whose first object has "
               f"one of the columns read here: {', '.join(sorted(record_keys))}" if unknown
               else "dataset / model metadata, not records")
        if _first_report(text, skipped):
            log.log(logging.WARNING if unknown else logging.INFO, "%s: %s (%s)", text, about, why)
    if not names:
        raise FileNotFoundError(f"no {kinds} data files at {text!r}" + (f" ({about}: {why})" if about else ""))
    return [Path(n) for n in sorted(names)]


class DataFileError(ValueError):
    """A data file that cannot be used as a whole (unreadable table, missing columns); the message names the file."""


@contextmanager
def data_path_errors(key: str) -> Iterator[None]:
    """Re-raise a missing or unreadable data path (FileNotFoundError, DataFileError) met inside the
    block as a ConfigError that starts with `key` (e.g. "data.train_path")."""
    try:
        yield
    except (FileNotFoundError, DataFileError) as e:
        raise ConfigError(f"{key}: {e}") from None
