"""Messages JSONL read as byte offsets (`MessagesRecords` over `TableRows`): the records, their locations and the
bad records at open equal the eager reader's (`read_messages_jsonl`, every record held in memory); a file that
changes after it was opened gives named bad records, not whatever now sits at the old offsets."""
from __future__ import annotations

import json
import os

import pytest

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.sources import MessagesRecords
from megatron_vlm.data.table_rows import TableRows, read_json_lines


def _write(folder, write_image):
    write_image(folder / "a.png", size=(56, 56), seed=0)
    good = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "q"}]},
                         {"role": "assistant", "content": "a"}], "id": 7}
    lines = ["\ufeff" + json.dumps(good), "", json.dumps({"messages": "not a list"}), "{broken", b"\xff\xfe".hex(),
             json.dumps({"no_messages": 1}), json.dumps({"messages": [{"role": "user", "content": "é ü"},
                                                                      {"role": "assistant", "content": "x"}]}),
             "[1, 2]", json.dumps(good)]
    (folder / "sub").mkdir()
    (folder / "sub" / "b.jsonl").write_bytes(b"\xff\xfe not utf-8\n" + (json.dumps(good) + "\n").encode())
    (folder / "a.jsonl").write_text("\n".join(lines))  # no newline after the last line
    return folder


def test_offset_rows_equal_the_eager_reader(tmp_path, write_image):
    folder = _write(tmp_path, write_image)
    want_bad, got_bad = BadRecordLog(), BadRecordLog()
    want = read_messages_jsonl(folder, bad_records=want_bad)
    src = MessagesRecords(folder, None, got_bad)
    assert len(src) == len(want) == 4
    for i, rec in enumerate(want):
        got = src.get(i)
        assert (got.messages, got.source, got.index, got.meta) == (rec.messages, rec.source, rec.index, rec.meta)
        assert src.locate(i) == (rec.source, rec.index)
    assert got_bad.to_dict() == want_bad.to_dict()
    assert {b.category for b in got_bad.entries} == {"invalid_record", "malformed_json", "invalid_encoding"}
    rows = TableRows(folder)  # the parsed-at-once reader of one file is the reference for the offsets
    eager = [(str(f), n, obj) for f in rows.files for n, obj in read_json_lines(f)[0]]
    assert [(*rows.locate(i), rows.row(i)) for i in range(len(rows))] == eager


def test_a_file_changed_after_opening_gives_named_bad_records(tmp_path, write_image):
    folder = _write(tmp_path, write_image)
    rows = TableRows(folder / "a.jsonl")
    first = rows.row(0)
    path = folder / "a.jsonl"
    path.write_text("\n" + path.read_text())  # every line one further down
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(BadRecordError, match="changed after it was opened") as e:
        rows.row(0)
    assert e.value.category == "invalid_record" and "a.jsonl" in str(e.value)
    assert first["id"] == 7
