"""`max_samples = N` evaluates the first N rows, and only their bad records are the benchmark's.

A malformed line is found when the files are opened, before `max_samples` cuts the rows, and one past the N-th
row was listed (and counted) among the bad records of a benchmark that never reached it."""
from __future__ import annotations

import json

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.eval.benchmarks import open_benchmark


def _msg(answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": answer}]})


def _col(answer: str) -> str:
    return json.dumps({"q": "What is it?", "a": answer})


def _open(path, fmt: str, max_samples: int):
    cols = {"question": "q", "answer": "a"} if fmt == "columns" else {}
    cfg = BenchmarkConfig(name="b", path=str(path), format=fmt, columns=cols, max_samples=max_samples)
    return open_benchmark(cfg, template="{problem}")


def test_messages_bad_lines_after_the_last_evaluated_row_are_not_counted(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join([_msg("1"), "{bad", _msg("2"), _msg("3"), "{bad", _msg(".")]) + "\n")
    (tmp_path / "b.jsonl").write_text("{bad\n" + _msg("4") + "\n")
    opened = _open(tmp_path, "messages", 2)
    assert len(opened.source) == 2
    assert [r.index for r in opened.bad_records.entries] == [2]  # line 2 lies between the 2 rows; the rest after
    assert len(_open(tmp_path, "messages", 0).bad_records) == 4  # all rows: every bad line counts
    # 4 rows: a.jsonl lines 1, 3, 4 and 6 (refused: "." is no answer), so b.jsonl's bad line 1 lies after them
    assert [(r.source.endswith("b.jsonl"), r.index) for r in _open(tmp_path, "messages", 4).bad_records.entries] == [
        (False, 2), (False, 5), (False, 6)]


def test_columns_bad_lines_after_the_last_evaluated_row_are_not_counted(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join([_col("1"), "{bad", _col("2"), "{bad"]) + "\n")
    opened = _open(tmp_path / "a.jsonl", "columns", 1)
    assert len(opened.source) == 1 and len(opened.bad_records) == 0
    # max_samples covering every row: the whole file is evaluated, its last line included
    assert [r.index for r in _open(tmp_path / "a.jsonl", "columns", 2).bad_records.entries] == [2, 4]
    assert len(_open(tmp_path / "a.jsonl", "columns", 0).bad_records) == 2
