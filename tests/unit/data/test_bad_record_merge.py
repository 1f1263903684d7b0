"""Merging bad-record logs (ranks / workers -> one summary) keeps the skip counts: a record skipped
3 times on one rank and twice on another is one bad record with 5 skips, not 2."""
from __future__ import annotations

import json

from megatron_vlm.data.bad_records import BadRecordLog


def test_merge_sums_skip_counts(tmp_path):
    a, b = BadRecordLog(), BadRecordLog()
    for _ in range(3):
        a.add("train.jsonl", 7, "missing_image", "no such file: x.png")
    b.add("train.jsonl", 7, "missing_image", "no such file: x.png")
    b.add("train.jsonl", 7, "missing_image", "no such file: x.png")
    b.add("train.jsonl", 9, "malformed_json", "Expecting value")
    merged = BadRecordLog()
    for part in (a.to_dict()["records"], b.to_dict()["records"]):
        json.dumps(part)  # what all_gather_object ships must be plain data
        merged.extend(part)
    d = merged.to_dict()
    assert d["num_bad_records"] == 2
    assert d["num_skips"] == 6
    assert {(r["index"], r["skips"]) for r in d["records"]} == {(7, 5), (9, 1)}
    # plain entries (no "skips" key) still count one each
    again = BadRecordLog()
    again.extend([{"source": "t", "index": 1, "category": "malformed_json", "detail": "x"}] * 2)
    assert again.total_skips == 2 and len(again) == 1


def test_merge_by_shard_counts_ranks_of_one_data_shard_once():
    """tp / cp ranks (and pp stages) of one data-parallel rank skip the same records: one of them counts;
    different data-parallel ranks add up; a log without a shard (None) always counts."""
    from megatron_vlm.data.bad_records import merge_by_shard

    def log(*indices):
        out = BadRecordLog()
        for i in indices:
            out.add("d.jsonl", i, "corrupt_image", "x")
        return out.to_dict()["records"]

    merged = merge_by_shard([(0, log(5)), (0, log(5)), (1, log(5, 8)), (1, log(5, 8)), (None, log(9))])
    assert {(r["index"], r["skips"]) for r in merged.to_dict()["records"]} == {(5, 2), (8, 1), (9, 1)}


def test_a_summary_that_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """On a full disk the summary's temporary file was left behind (an empty `bad_records.json.tmp` in the run
    folder, seen on a full tmpfs); the error is still raised to the caller, which logs it."""
    import errno
    import os

    import pytest

    log = BadRecordLog()
    log.add("train.jsonl", 7, "missing_image", "no such file: x.png")

    def full(fd):  # the file is created and written; its blocks do not fit when they are flushed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        log.write_summary(tmp_path / "bad_records.json")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
