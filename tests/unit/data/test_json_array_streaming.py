"""A JSON array file (LLaVA's llava_v1_5_mix665k.json, ShareGPT-style .json) is indexed by streaming over its bytes.

Opening one used to read the whole file and decode it to one str (`json.load`-like), twice the file's size or more
in memory on every rank for a multi-GB annotation file, just to find where each element starts and ends. The index
is now built by an incremental scan that keeps a window of the file and the element at hand; each element is then
read by seeking, as JSON-lines rows are. `json.load` of the whole file is the reference for the rows; the peak
memory of opening a generated file of tens of MB is measured with tracemalloc.
"""
from __future__ import annotations

import functools
import json
import random
import tracemalloc

import pytest

from megatron_vlm.data import table_rows
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.data_files import DataFileError
from megatron_vlm.data.table_rows import TableRows

TRICKY = [
    {"id": "a", "conversations": [{"from": "human", "value": "<image>\nIs [this] {a} \"quote\"?"},
                                  {"from": "gpt", "value": "Yes, ] and } and , inside a string."}]},
    {"nested": {"deep": [[[{"x": [1, 2, {"y": None}]}]], {}], "e": []}, "n": -1.5e3, "t": True, "f": False},
    {"esc": "back\\slash at the end\\", "quote": "\\\"", "u": "caf\u00e9 \u65e5\u672c \U0001f600", "ctl": "tab\tnl\n"},
    {"empty": "", "s": "\\", "b": "a\\\\\"b"},
    7, "not an object", ["a", "list"], None,
    {"last": "\u2028\u2029"},
]


def _layouts(values):
    """The same array written as json.dumps writes it, pretty-printed, with \\u escapes, and with odd whitespace
    (tabs, CRLF, blank lines) between elements; non-ASCII characters raw in most of them."""
    raw = [json.dumps(v, ensure_ascii=False) for v in values]
    return {
        "compact": json.dumps(values, ensure_ascii=False),
        "pretty": json.dumps(values, ensure_ascii=False, indent=2),
        "escaped": json.dumps(values),
        "spaced": "\ufeff \r\n\t[ \r\n" + " ,\r\n\n\t ".join(raw) + "\n\n ]\r\n \t",
        "tight": "[" + ",".join(raw) + "]",
    }


def _reference(path):
    """What the rows must be: json.load's objects, with the index of every element that is not one."""
    with open(path, encoding="utf-8-sig") as f:
        values = json.load(f)
    good = [(k, v) for k, v in enumerate(values) if isinstance(v, dict)]
    bad = [k for k, v in enumerate(values) if not isinstance(v, dict)]
    return good, bad


def _rows(path):
    rows = TableRows(path)
    return [(rows.locate(i)[1], rows.row(i)) for i in range(len(rows))], [k for _, k, _ in rows.errors]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("layout", ["compact", "pretty", "escaped", "spaced", "tight"])
def test_rows_equal_json_load_whatever_the_layout_and_window(tmp_path, monkeypatch, layout, chunk):
    monkeypatch.setattr(table_rows, "ARRAY_CHUNK", chunk)  # element and string boundaries fall across windows
    path = tmp_path / "tricky.json"
    path.write_text(_layouts(TRICKY)[layout], encoding="utf-8")
    assert _rows(path) == _reference(path)


def _random_value(rng, depth=0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False, 0, -12, 3.25, 1e-7])
    if kind in (1, 2, 3, 4):
        alphabet = 'ab []{},:"\\/\n\t\u00e9\u65e5\U0001f600'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return {_random_value(rng, 5) if rng.random() < .5 else f"k{j}": _random_value(rng, depth + 1)
                for j in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_random_arrays_equal_json_load_and_truncations_are_file_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(table_rows, "ARRAY_CHUNK", 5)
    rng = random.Random(0)
    for n in range(40):
        values = [_random_value(rng, 1) if rng.random() < .2 else {"i": n, "v": _random_value(rng)}
                  for _ in range(rng.randrange(6))]
        path = tmp_path / f"r{n}.json"
        path.write_text(_layouts(values)[rng.choice(["compact", "pretty", "escaped", "spaced"])], encoding="utf-8")
        assert _rows(path) == _reference(path)
    text = json.dumps(TRICKY, indent=1).encode()
    end = text.rindex(b"]")
    for cut in range(1, end, 3):  # everywhere inside the array: an element or a string cut short
        (tmp_path / "cut.json").write_bytes(text[:cut])
        with pytest.raises(DataFileError, match="cut.json"):
            TableRows(tmp_path / "cut.json")


def test_broken_files_name_the_file_and_element_and_bad_elements_are_counted(tmp_path):
    cases = {
        "cut_in_string.json": ('[{"a": "b"}, {"a": "unfinished', "element 1: the file ends inside the array"),
        "cut_after_comma.json": ('[{"a": 1},\n', "element 1: the file ends inside the array"),
        "no_close.json": ('[{"a": 1}', "element 0: the file ends inside the array"),
        "trailing_comma.json": ('[{"a": 1}, ]', "element 1: expected a value"),
        "missing_comma.json": ('[{"a": 1} {"b": 2}]', "element 0: Extra data"),
        "bad_inside.json": ('[{"a": 1}, {"a": tru}]', "element 1: Expecting value"),
        "after_close.json": ('[{"a": 1}] {"b": 2}', "more data after the closing ']'"),
        "unbalanced.json": ('[{"a": [1}, 2]', "element 0: the file ends inside the array"),
    }
    for name, (text, why) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(DataFileError, match=name) as e:
            TableRows(tmp_path / name)
        assert why in str(e.value), (name, str(e.value))
    # An element that is not UTF-8 or is nested too deeply is one bad record, as such a JSON line is: its bytes are
    # delimited all the same (a byte >= 0x80 is never a quote, bracket or comma).
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "odd.json").write_bytes(b'[{"a": 1}, {"a": "\xff\xfe"}, ' + deep.encode() + b', {"a": 2}]')
    log = BadRecordLog()
    rows = TableRows(tmp_path / "odd.json", bad_records=log)
    assert [(rows.locate(i)[1], rows.row(i)) for i in range(len(rows))] == [(0, {"a": 1}), (3, {"a": 2})]
    assert [(b.index, b.category) for b in log.entries] == [(1, "invalid_encoding"), (2, "malformed_json")]


def _big_array_file(path, target_bytes):
    """A LLaVA-like array file of about `target_bytes`, pretty-printed, non-ASCII text and brackets in the strings."""
    turn = "Describe the [image] {in} detail, \"quoted\" and caf\u00e9 \u65e5\u672c. " * 48
    rec = {"id": "000000000000", "image": "coco/train2017/000000000000.jpg",
           "conversations": [{"from": "human", "value": "<image>\n" + turn}, {"from": "gpt", "value": turn[::-1]}]}
    one = json.dumps(rec, indent=2, ensure_ascii=False)
    n = target_bytes // len(one.encode())
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(one.replace("000000000000", f"{i:012d}") for i in range(n)))
        f.write("\n]\n")
    return n


def test_opening_a_large_array_file_holds_far_less_than_the_file(tmp_path):
    path = tmp_path / "big.json"
    n = _big_array_file(path, 24 << 20)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        rows = TableRows(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows) == n and rows.locate(n - 1)[1] == n - 1
    assert rows.row(n - 1)["id"] == f"{n - 1:012d}" and rows.row(0)["image"].endswith("000000000000.jpg")
    assert peak < size / 4, f"opening a {size / 2**20:.1f} MiB array file peaked at {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("text", ['[{"a": 1}]]', '[{"a": 1}][{"b": 2}]', '[{"a": 1}] x', '\n[{"a": 1}]\n{"b": 2}',
                                  '[\n\n]]'])
def test_data_after_the_array_is_refused_when_the_window_ends_at_its_bracket(tmp_path, monkeypatch, text):
    """Two arrays one after the other (two files concatenated) or trailing text are refused as json.load refuses
    them, wherever the window ends: a window ending just at the closing ']' once skipped the check."""
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    monkeypatch.setattr(table_rows, "ARRAY_CHUNK", text.index("]") + 1)  # the first window ends at the ']'
    (tmp_path / "two.json").write_text(text)
    with pytest.raises(DataFileError, match="more data after the closing"):
        TableRows(tmp_path / "two.json")


def _outcome(path, fast):
    """What opening the file gives with the fast scan or with the byte scan alone: every good element's index and
    byte span, the columns and the bad records, or the DataFileError's message."""
    scan = table_rows._ArrayScan
    try:
        table_rows._ArrayScan = functools.partial(scan, fast=fast)
        indices, starts, ends, columns, errors = table_rows._scan_json_array(path)
    except DataFileError as e:
        return str(e)
    finally:
        table_rows._ArrayScan = scan
    return (indices.tolist(), starts.tolist(), ends.tolist(), columns,
            [(k, e.category, e.detail) for k, e in errors])


def _mutants(data, rng, n):
    """`data` with one byte deleted, inserted or replaced, n times: structure, escapes, whitespace, a byte that is
    not UTF-8, a lone UTF-8 lead byte, and digits that run a number on."""
    odd = [b"[", b"]", b"{", b"}", b",", b'"', b"\\", b" ", b"\n", b"\xff", b"\xe6", b"7", b":"]
    for _ in range(n):
        i = rng.randrange(len(data))
        how = rng.randrange(3)
        yield data[:i] + (b"" if how == 0 else rng.choice(odd)) + data[i + (how != 1):]


@pytest.mark.parametrize("chunk", [16, 37, 100, 1 << 20])
def test_fast_scan_gives_the_byte_scans_spans_and_errors(tmp_path, monkeypatch, chunk):
    """Parsing each element with raw_decode over a decoded window gives what the byte scan alone gives: the same
    spans on valid files (both equal to json.load's rows), and on mutated ones the same bad records or the same
    DataFileError, wherever the windows end (multi-byte characters and elements cut by them)."""
    monkeypatch.setattr(table_rows, "ARRAY_CHUNK", chunk)
    rng = random.Random(chunk)
    path = tmp_path / "m.json"
    files = [text.encode() for text in _layouts(TRICKY).values()]
    for n in range(8):
        values = [_random_value(rng, 1) if rng.random() < .2 else {"i": n, "v": _random_value(rng)}
                  for _ in range(rng.randrange(1, 8))]
        files.append(_layouts(values)[rng.choice(["compact", "pretty", "escaped", "spaced", "tight"])].encode())
    for data in files:
        path.write_bytes(data)
        fast = _outcome(path, True)
        assert fast == _outcome(path, False)
        assert _rows(path) == _reference(path)
        for mutant in _mutants(data, rng, 25):
            path.write_bytes(mutant)
            assert _outcome(path, True) == _outcome(path, False), mutant


def test_a_number_too_long_for_int_is_one_bad_record_in_arrays_and_json_lines(tmp_path):
    """json.loads refuses an integer of more digits than Python converts (ValueError, not JSONDecodeError); such an
    element or line is one bad record, as one nested too deeply is, not a crash of the whole open."""
    digits = "1" * 5000
    with pytest.raises(ValueError):
        json.loads(digits)
    (tmp_path / "a.json").write_text('[{"a": 1}, {"a": ' + digits + '}, {"a": 2}]')
    (tmp_path / "l.jsonl").write_text('{"a": 1}\n{"a": ' + digits + '}\n{"a": 2}\n')
    for name, where in (("a.json", [0, 2]), ("l.jsonl", [1, 3])):
        log = BadRecordLog()
        rows = TableRows(tmp_path / name, bad_records=log)
        assert [(rows.locate(i)[1], rows.row(i)) for i in range(len(rows))] == [(where[0], {"a": 1}),
                                                                                 (where[1], {"a": 2})]
        assert [(b.index, b.category) for b in log.entries] == [(where[0] + 1, "malformed_json")]
