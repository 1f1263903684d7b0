"""The one reader of `[data]` files: every row of every file at a path, in order, with its location.

SFT (`hf_source.HFRecords`, `messages.read_messages_jsonl`) and GRPO (`rl.data.load_prompt_dataset`)
read their files through `TableRows`, so both see the same rows in the same order and name a bad
row the same way:

- files: `data_files.find_data_files` (a file, a folder searched recursively, or a glob; sorted);
- .parquet / .arrow files: Hugging Face `datasets` tables (memory-mapped; parquet is converted
  once into the datasets cache), rows returned as plain Python values without decoding anything:
  an Image feature is its {"bytes", "path"} struct, a list of them a list of structs; a file that
  does not open as a table is a `DataFileError` naming it (the whole file, not one record);
- every other file: JSON lines. Blank lines are not rows; a line that is not a JSON object (or
  nested too deeply to parse, or holding an integer too long for int()) is a bad record ("malformed_json"), a line that is not UTF-8 one
  ("invalid_encoding"); both are reported at open time and left out of the rows;
- a file of one pretty-printed JSON object (its first line opens an object that does not end there, the whole
  file one object, at most 16 MiB) is one row at line 1, as the same object on one line is
  (`data_files.one_json_object`), not one bad record per line;
- a file whose first non-blank character is "[" is one JSON array of objects (LLaVA's
  llava_v1_5_mix665k.json, LLaMA-Factory's and ms-swift's .json files), whatever its suffix: each
  element is a row, located by its 0-based index; an element that is not an object (or nested too
  deeply to parse, or holding an integer too long for int()) is a bad record ("malformed_json"), one that is not UTF-8 one ("invalid_encoding"),
  as for a JSON line; a file that is not one JSON array (a syntax error anywhere, a truncated file)
  cannot be split into elements and is a `DataFileError` naming the file and the element where it
  breaks;
- a JSON-lines file is held as the byte offsets of its good lines, each row parsed again when read
  (`_JsonLinesPart`): a million rows cost 16 MB, not gigabytes of dicts, and the index is built in `array("q")` (about
  32 bytes a row while opening, with the final copy, against ~90 with Python lists);
- a JSON array file is held the same way, as the byte span of each good element, found by streaming
  over the file (`_ArrayScan`): opening a multi-GB annotation file holds a window of it and one
  element, not its text;
- a row's location is (file, index): the 1-based line of a JSON-lines file, the 0-based element of a
  JSON array file or the 0-based row of a table (the `bad_records` convention), for record sources,
  bad-record logs and prompt ids.

Rows are addressed by a global index 0 .. len-1 over all files; `row(i)` is a dict of the row's
columns. Mapping rows to conversations is the callers' business (`[data] columns`).
"""
from __future__ import annotations

import bisect
import codecs
import json
import os
import re
from array import array
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.data_files import (
    HF_SUFFIXES,
    RECORD_KEYS,
    TABLE_SUFFIXES,
    DataFileError,
    file_signature,
    find_data_files,
    one_json_object,
)

__all__ = ["TableRows", "read_json_lines"]


def _parse_json_line(raw: bytes, first: bool) -> dict:
    """One JSON-lines line as an object; BadRecordError for anything else (never another exception)."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise BadRecordError("invalid_encoding", f"not valid UTF-8: {e.reason} at byte {e.start} "
                                                 f"({raw[max(0, e.start - 8):e.end + 8]!r})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRecordError("malformed_json", str(e)) from None
    except RecursionError:
        raise BadRecordError("malformed_json", "nested too deeply for the JSON parser") from None
    except ValueError as e:  # not a JSONDecodeError: an integer of more digits than int() converts
        raise BadRecordError("malformed_json", str(e)) from None
    if not isinstance(obj, dict):
        raise BadRecordError("malformed_json", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_json_lines(file: Path) -> tuple[list[tuple[int, dict]], list[tuple[int, BadRecordError]]]:
    """(line, object) of each JSON-object line and (line, error) of each bad one; lines are 1-based.

    The file is read as bytes and each line decoded on its own, so a line that is not UTF-8 (or a
    JSON value nested deeper than the parser's recursion limit) is one bad record, not a failed
    load. Lines end at "\\n" only; a UTF-8 byte-order mark before the first line is ignored."""
    rows: list[tuple[int, dict]] = []
    errors: list[tuple[int, BadRecordError]] = []
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip() or (lineno == 1 and not raw.strip().removeprefix(b"\xef\xbb\xbf")):
                continue
            try:
                rows.append((lineno, _parse_json_line(raw, first=lineno == 1)))
            except BadRecordError as e:
                errors.append((lineno, e))
    return rows, errors


def _scan_json_lines(file: Path) -> tuple[np.ndarray, np.ndarray, list[str], list[tuple[int, BadRecordError]]]:
    """(1-based line, byte offset) of each JSON-object line as int64 arrays, the rows' keys (`_Columns`), and
    (line, error) of each bad one: `read_json_lines` without keeping the objects."""
    lines, offsets = array("q"), array("q")  # 8 bytes a number, not a list slot and a Python int (8 + 28)
    errors: list[tuple[int, BadRecordError]] = []
    columns = _Columns()
    offset = 0
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip() or (lineno == 1 and not raw.strip().removeprefix(b"\xef\xbb\xbf")):
                continue
            try:
                obj = _parse_json_line(raw, first=lineno == 1)
            except BadRecordError as e:
                # a fresh error: the raised one's traceback / context would keep this frame and its callers
                # (their lists of every row) alive for as long as the error is kept
                errors.append((lineno, BadRecordError(e.category, e.detail)))
                continue
            columns.add(obj)
            lines.append(lineno)
            offsets.append(start)
    return _int64(lines), _int64(offsets), columns.names(), errors


class _Columns:
    """The columns of a JSON file's rows: every key any row has, in the order first seen, as Hugging Face `datasets`
    infers a JSON file's columns (a row without a key reads null there). Only the first `MAX_SHAPES` distinct key
    tuples are remembered (rows mostly share a few); past them every row's keys are merged."""

    MAX_SHAPES = 4096

    def __init__(self) -> None:
        self._keys: dict[str, None] = {}
        self._shapes: set[tuple] = set()

    def add(self, row: dict) -> None:
        shape = tuple(row)
        if shape in self._shapes:
            return
        if len(self._shapes) < self.MAX_SHAPES:
            self._shapes.add(shape)
        for k in shape:
            self._keys.setdefault(k)

    def names(self) -> list[str]:
        return list(self._keys)


def _int64(xs: array) -> np.ndarray:
    """An `array("q")` as an int64 numpy array of its own (the array's spare room is not kept)."""
    return np.frombuffer(xs, dtype=np.int64).copy()


class _JsonLinesPart:
    """A JSON-lines file as the byte offsets of its good lines: each row is parsed again when asked for.

    Holding a million parsed rows as Python dicts costs gigabytes per rank (and DataLoader workers copy
    those pages as they touch their reference counts); two int64 per row cost 16 bytes. The file was
    validated when opened; a file that changed since (size or modification time) makes its rows bad
    records ("invalid_record", naming the file) instead of reading whatever is at the old offsets now."""

    def __init__(self, file: Path, lines: np.ndarray, offsets: np.ndarray, columns: list[str]):
        self.file = file
        self.lines, self.offsets, self.columns = lines, offsets, columns
        st = file.stat()
        self._signature = (st.st_size, st.st_mtime_ns)

    def __len__(self) -> int:
        return len(self.lines)

    def index(self, k: int) -> int:
        return int(self.lines[k])

    def _read(self, start: int, end: Optional[int]) -> bytes:
        """Bytes [start, end) of the file (None: to its end), refused if the file changed since it was opened. The
        file is opened per row: a folder of thousands of files must not hold as many open."""
        fd = os.open(self.file, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns) != self._signature:
                raise BadRecordError("invalid_record", f"{self.file} changed after it was opened (size or "
                                                       "modification time); its rows can no longer be read")
            return os.pread(fd, (st.st_size if end is None else end) - start, start)
        finally:
            os.close(fd)

    def row(self, k: int) -> dict:
        end = int(self.offsets[k + 1]) if k + 1 < len(self.offsets) else None
        raw = self._read(int(self.offsets[k]), end)
        return _parse_json_line(raw.split(b"\n", 1)[0], first=int(self.lines[k]) == 1)  # blank / bad lines may follow


class _ObjectPart:
    """A file of one pretty-printed JSON object (`data_files.one_json_object`, at most 16 MiB): one row, at line 1,
    parsed again when asked for (a fresh dict each time, as the other parts give)."""

    def __init__(self, file: Path, text: str):
        self.file, self._text = file, text
        self.columns = list(json.loads(text))

    def __len__(self) -> int:
        return 1

    def index(self, k: int) -> int:
        return 1

    def row(self, k: int) -> dict:
        return json.loads(self._text)


def _is_json_array(file: Path) -> bool:
    """Whether the file's first non-blank byte (after a UTF-8 byte-order mark) is "[": one JSON array, not JSON lines
    (no JSON-lines row starts so: rows are objects)."""
    with open(file, "rb") as f:
        head = f.read(1 << 16)
        while head:
            stripped = head.removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped.startswith(b"[")
            head = f.read(1 << 16)
    return False


_JSON_WS = b" \t\n\r"

ARRAY_CHUNK = 1 << 20
"""Bytes read at a time while a JSON array file is scanned: what opening one holds, with the element at hand."""

_STRUCTURE = re.compile(rb'["\[\]{},]')
"""Where the array scan stops outside strings: a quote (a string starts), a bracket or a comma."""


def _string_end(buf: bytes, i: int) -> int:
    """The index just past the string that starts with the quote at `buf[i]`, or -1 when it does not end in `buf`.

    A quote ends the string unless an odd number of backslashes precede it; `find` jumps over everything else
    (escaped text such as ensure_ascii's \\uXXXX costs nothing per character, a regex over escapes would)."""
    j = buf.find(b'"', i + 1)
    while j >= 0:
        k = j
        while buf[k - 1] == 0x5C:  # backslashes before the quote; buf[i] is a quote, so this stops by i
            k -= 1
        if (j - k) % 2 == 0:
            return j + 1
        j = buf.find(b'"', j + 1)
    return -1


class _ArrayScan:
    """The elements of a file holding one JSON array, as (start byte, end byte, bytes, value), read `ARRAY_CHUNK` at a
    time.

    Why not `json.load`: a multi-GB annotation file decoded whole costs several times its size on every rank, only to
    learn where each element starts and ends. Only a window of the file and the current element are held.

    Two ways to find an element's end, both over the window:
    - fast (the default): the window is decoded and `JSONDecoder.raw_decode` parses one element at C speed, which
      also gives its end; the element is yielded parsed (bytes None), its byte span being the UTF-8 length of the text
      it took. It is trusted only when a "," or "]" follows it inside the decoded text;
    - byte scan (`_byte_element`): strings, escapes and bracket depth tracked in the bytes, the element yielded as
      bytes for the caller to parse. Splitting there is byte-safe in any encoding compatible with ASCII (a byte >= 0x80
      is never a quote, a backslash, a bracket or a comma), and a wrong split (unbalanced brackets) cannot go unseen:
      the pieces then do not each parse as one JSON value.
    Whatever the fast way does not take (the element cut by the window's end, or longer than a window, bytes that are
    not UTF-8, a syntax error, nesting too deep, the empty array) is read again by the byte scan, which reads on as
    needed, and the fast way resumes after it. Errors and bad records are thus exactly the byte scan's, and on valid
    JSON both ways give the same spans. `fast=False` uses only the byte scan (the reference the tests compare with).
    `broken(k, why)` is the DataFileError for a file that is not one array (k: the element where it breaks)."""

    def __init__(self, file: Path, fast: bool = True):
        self.file = file
        self.fast = fast
        self.k = 0
        """The index of the element being read (of the next one, between elements)."""

    def broken(self, k: int, why: str) -> DataFileError:
        return DataFileError(f"{self.file}: not one JSON array (read as one since it starts with '['), at element {k}: "
                             f"{why}")

    def __iter__(self) -> Iterator[tuple[int, int, Optional[bytes], Any]]:
        with open(self.file, "rb") as f:
            buf, base = f.read(max(ARRAY_CHUNK, 3)), 0  # the bytes held and the file offset of buf[0]
            if buf.startswith(b"\xef\xbb\xbf"):
                buf, base = buf[3:], 3
            pos = len(buf) - len(buf.lstrip(_JSON_WS))
            while pos == len(buf):  # only whitespace so far
                more = f.read(ARRAY_CHUNK)
                if not more:
                    raise self.broken(0, "no '['")
                buf, base, pos = more, base + len(buf), len(more) - len(more.lstrip(_JSON_WS))
            if buf[pos:pos + 1] != b"[":
                raise self.broken(0, "no '['")
            pos += 1  # from here on, pos is where the next element's bytes begin: just after the "[" or its ","
            nonempty = False
            closed = False
            while not closed:
                if self.fast:
                    text = _decoded_prefix(memoryview(buf)[pos:])
                    ascii_text = text.isascii()
                    c = 0  # the character text[c] begins at byte buf[pos]
                    while True:
                        s = _ws_end(text, c).end()  # type: ignore[union-attr]  # "[ \t\n\r]*" always matches
                        try:
                            value, e = _raw_decode(text, s)
                        except (ValueError, RecursionError):
                            break
                        t = _ws_end(text, e).end()  # type: ignore[union-attr]
                        if t == len(text) or text[t] not in ",]":
                            break
                        start = pos + s - c
                        end = start + (e - s if ascii_text else len(text[s:e].encode("utf-8")))
                        yield base + start, base + end, None, value
                        del value
                        nonempty = True
                        pos, c = end + t - e + 1, t + 1
                        if text[t] == "]":
                            closed = True
                            break
                        self.k += 1
                    del text
                    if closed:
                        break
                buf, base, pos, span, t = self._byte_element(f, buf, base, pos)
                if span is not None:
                    yield span[0], span[1], span[2], None
                    nonempty = True
                if t == 0x5D:  # "]": the array's end
                    break
                self.k += 1
            rest = buf[pos:]
            while True:  # read to the end even when the window ends just at the ']'
                if rest.strip(_JSON_WS):
                    raise self.broken(self.k + 1 if nonempty else 0, "more data after the closing ']'")
                rest = f.read(ARRAY_CHUNK)
                if not rest:
                    break

    def _byte_element(self, f, buf: bytes, base: int, pos: int
                      ) -> tuple[bytes, int, int, Optional[tuple[int, int, bytes]], int]:
        """The element whose bytes begin at buf[pos], by the byte scan: (buf, base, pos just past its "," or "]",
        (start byte, end byte, bytes) or None for the empty array's nothing, the "," or "]"), reading on as needed."""
        elem = pos  # where the element's bytes begin
        depth = 0  # bracket depth inside the element
        search = _STRUCTURE.search
        while True:
            m = search(buf, pos)
            at = len(buf) if m is None else m.start()
            t = buf[at] if m is not None else -1
            if t == 0x22:  # '"': a string, whose brackets and commas are text
                end = _string_end(buf, at)
                if end > 0:
                    pos = end
                    continue
            if t == -1 or t == 0x22:  # nothing more in this window, or a string that does not end in it
                more = f.read(max(ARRAY_CHUNK, len(buf) - elem))  # doubles for an element longer than a window
                if not more:
                    raise self.broken(self.k, "the file ends inside the array")
                buf, base, pos, elem = buf[elem:] + more, base + elem, at - elem, 0  # from the string's quote
                continue
            pos = at + 1
            if t in b"[{":
                depth += 1
                continue
            if depth:  # a comma or closing bracket inside the element
                if t != 0x2C:
                    depth -= 1
                continue
            if t == 0x7D:  # "}" at depth 0: left for the element's parse to refuse
                continue
            raw = buf[elem:at]
            value = raw.strip(_JSON_WS)
            if value:
                lead = len(raw) - len(raw.lstrip(_JSON_WS))
                return buf, base, pos, (base + elem + lead, base + elem + lead + len(value), value), t
            if t == 0x2C or self.k:  # "[," / ",," / ", ]"; "[ ]" is the empty array
                raise self.broken(self.k, "expected a value")
            return buf, base, pos, None, t


def _decoded_prefix(data: memoryview) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, decoded: a character cut by the window's end or
    a byte that is not UTF-8 ends it (what follows is left to the next window or to the byte scan)."""
    try:
        return codecs.utf_8_decode(data, "strict", False)[0]  # not final: a cut character at the end is left out
    except UnicodeDecodeError as e:
        return codecs.utf_8_decode(data[:e.start], "strict", False)[0]


_ws_end = re.compile(r"[ \t\n\r]*").match
_raw_decode = json.JSONDecoder().raw_decode


def _scan_json_array(file: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str],
                                          list[tuple[int, BadRecordError]]]:
    """(0-based index, start byte, end byte) of each object element of a file holding one JSON array, the objects'
    keys (`_Columns`), and (index, error) of each element that is a bad record: not an object, not UTF-8, nested too
    deeply to parse (as for a JSON line). DataFileError when the file is not one JSON array (a syntax error, a
    truncated file): its elements cannot be told apart then."""
    indices, starts, ends = array("q"), array("q"), array("q")  # 8 bytes a number, not a Python int's 28 + 8
    errors: list[tuple[int, BadRecordError]] = []
    columns = _Columns()
    scan = _ArrayScan(file)
    for start, end, raw, obj in scan:
        k = scan.k
        try:
            if raw is not None:  # not parsed by the scan
                obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            errors.append((k, BadRecordError("invalid_encoding", f"array element {k}: not valid UTF-8: {e.reason} at "
                                                                 f"byte {start + e.start}")))
            continue
        except json.JSONDecodeError as e:
            raise scan.broken(k, f"{e.msg}: line {e.lineno} column {e.colno} of the element (byte {start})") from None
        except RecursionError:
            errors.append((k, BadRecordError("malformed_json", f"array element {k}: nested too deeply for the JSON "
                                                               "parser")))
            continue
        except ValueError as e:  # not a JSONDecodeError: an integer of more digits than int() converts
            errors.append((k, BadRecordError("malformed_json", f"array element {k}: {e}")))
            continue
        if isinstance(obj, dict):
            columns.add(obj)
            indices.append(k)
            starts.append(start)
            ends.append(end)
        else:
            errors.append((k, BadRecordError("malformed_json", f"array element {k}: expected a JSON object, "
                                                               f"got {type(obj).__name__}")))
        del obj
    return _int64(indices), _int64(starts), _int64(ends), columns.names(), errors


class _JsonArrayPart(_JsonLinesPart):
    """A file of one JSON array as the byte span of each object element (see `_JsonLinesPart` for why); rows are
    located by their 0-based element index."""

    def __init__(self, file: Path, indices: np.ndarray, starts: np.ndarray, ends: np.ndarray, columns: list[str]):
        super().__init__(file, indices, starts, columns)
        self.ends = ends

    def row(self, k: int) -> dict:
        raw = self._read(int(self.offsets[k]), int(self.ends[k]))
        obj = json.loads(raw.decode("utf-8"))  # validated as an object when the file was opened
        if not isinstance(obj, dict):
            raise BadRecordError("invalid_record", f"{self.file} changed after it was opened")
        return obj


def _empty_parquet(file: Path):
    """A parquet file with its schema and no rows as an empty Dataset (`Dataset.from_parquet` fails on one:
    "BatchSize must be greater than 0"), else None: an empty file is a table of 0 rows, not an unreadable one."""
    import datasets
    import pyarrow.parquet as pq

    if file.suffix != ".parquet":
        return None
    try:
        if pq.read_metadata(file).num_rows != 0:
            return None
        return datasets.Dataset(pq.read_table(file))
    except Exception:  # not a parquet file at all: the caller's "cannot be read"
        return None


class _TablePart:
    def __init__(self, file: Path, cache_dir: Optional[str]):
        # `datasets` takes seconds to import; only tables need it, so JSON-lines reading stays cheap.
        import datasets

        try:
            if file.suffix == ".arrow":
                ds = datasets.Dataset.from_file(str(file))
            else:
                ds = datasets.Dataset.from_parquet(str(file), cache_dir=cache_dir)
        except Exception as e:  # pyarrow / datasets raise many types for a file that is not a table
            ds = _empty_parquet(file)
            if ds is not None:
                self.columns, self.table = list(ds.column_names), ds.with_format("arrow")
                return
            raise DataFileError(f"{file}: cannot be read as a {file.suffix} table ({type(e).__name__}: "
                                f"{str(e)[:300]})") from None
        self.columns = list(ds.column_names)
        self.table = ds.with_format("arrow")  # rows as raw Arrow values: nothing decoded

    def __len__(self) -> int:
        return len(self.table)

    def index(self, k: int) -> int:
        return k

    def row(self, k: int) -> dict:
        return self.table[k].to_pylist()[0]


class TableRows:
    """All rows of the data files at `path` (see module docstring).

    `bad_records`, when given, receives the malformed JSON lines (they are also kept in `errors`). `record_keys`: the
    columns a record is read from; a JSON-lines .json file in a folder or glob without one is not data
    (`data_files.find_data_files`)."""

    def __init__(self, path: str | os.PathLike, *, suffixes: tuple[str, ...] = HF_SUFFIXES,
                 bad_records: Optional[BadRecordLog] = None, cache_dir: Optional[str] = None,
                 record_keys: Collection[str] = RECORD_KEYS):
        self.name = os.fspath(path)
        self.files = find_data_files(path, suffixes, record_keys)
        self.errors: list[tuple[str, int, BadRecordError]] = []
        """(file, line, error) of each line (or JSON array element) that is not a JSON object, in file order."""
        self._parts: list[Any] = []
        self._starts: list[int] = []
        total = 0
        for file in self.files:
            if file.suffix in TABLE_SUFFIXES:
                part: Any = _TablePart(file, cache_dir)
            elif _is_json_array(file):
                indices, starts, ends, columns, errors = _scan_json_array(file)
                part = _JsonArrayPart(file, indices, starts, ends, columns)
                for k, err in errors:
                    self.errors.append((str(file), k, err))
                    if bad_records is not None:
                        bad_records.add_error(str(file), k, err)
            elif (text := one_json_object(file)) is not None:  # one pretty-printed object: one row, as on one line
                part = _ObjectPart(file, text)
            else:
                lines, offsets, columns, errors = _scan_json_lines(file)
                part = _JsonLinesPart(file, lines, offsets, columns)
                for lineno, err in errors:
                    self.errors.append((str(file), lineno, err))
                    if bad_records is not None:
                        bad_records.add_error(str(file), lineno, err)
            self._parts.append(part)
            self._starts.append(total)
            total += len(part)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def _part(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range for {self.name} ({self._len} rows)")
        p = bisect.bisect_right(self._starts, i) - 1  # the last part starting at or before i: never an empty one
        return p, i - self._starts[p]

    def row(self, i: int) -> dict:
        """The columns of row `i` (a global index over all files)."""
        p, k = self._part(int(i))
        return self._parts[p].row(k)

    def locate(self, i: int) -> tuple[str, int]:
        """(file, index) of row `i`: the 1-based line of a JSON-lines file, the 0-based element of a JSON array file,
        the 0-based row of a table."""
        p, k = self._part(int(i))
        return str(self.files[p]), self._parts[p].index(k)

    def file_of(self, i: int) -> Path:
        return self.files[self._part(int(i))[0]]

    def columns(self, file: Path) -> list[str]:
        """Column names of one of `files` (a JSON-lines or JSON array file: every key of its rows, in the order first
        seen, as `datasets` infers a JSON file's columns)."""
        return self._parts[self.files.index(Path(file))].columns

    def identity(self) -> list[dict]:
        """What the rows depend on, for caches: each file's resolved path, size and modification time."""
        return [{**file_signature(file), "n": len(part)} for file, part in zip(self.files, self._parts)]
