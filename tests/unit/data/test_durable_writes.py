"""The files a later start reads back reach the disk before they are trusted: a temporary sibling fsynced, renamed
over the final name, the folder fsynced.

A plain rename is atomic only while the host keeps running: after a power loss the page cache may not have written
the data (a file cut short or empty under the final name) or the folder the new name (the old content comes back).
The length cache is reused by the next job, an evaluation's kept results and its summary mark finished work, the
bad-record summary is what the user reads after a crash, and the metrics file cut back at a resume must not regrow the
rows of the steps run again. Each writer is called for real and the order of its system calls observed."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.lengths import compute_lengths
from megatron_vlm.data.sources import open_split
from megatron_vlm.durable import write_file_durably
from megatron_vlm.eval.report import write_eval_results
from megatron_vlm.eval.resume import PARTIAL_DIR, evaluate_benchmarks_kept
from megatron_vlm.training.loggers import _CsvSink
from tests.unit.durable_io import assert_durable, needs_proc_fd, record_io

pytestmark = needs_proc_fd


@pytest.mark.parametrize("name", ["bad_records.json", "bad_records.txt"])
def test_the_bad_record_summary(tmp_path, monkeypatch, name):
    log = BadRecordLog()
    log.add("data.jsonl", 3, "missing_image", "gone.png")
    events = record_io(monkeypatch)
    path = log.write_summary(tmp_path / name)
    assert_durable(events, path)
    assert "missing_image" in path.read_text()


def test_the_length_cache(tmp_path, monkeypatch, proc):
    rows = [{"messages": [{"role": "user", "content": f"question {i} " + "word " * i},
                          {"role": "assistant", "content": "answer"}]} for i in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_split(DataConfig(type="messages_jsonl", train_path=str(tmp_path / "data.jsonl"), num_workers=0),
                        "train", BadRecordLog())
    events = record_io(monkeypatch)
    got = compute_lengths(source, proc, max_frames=4, cache_dir=tmp_path / "cache")
    (cache,) = (tmp_path / "cache").glob("lengths-*.json")
    assert_durable(events, cache)
    assert json.loads(cache.read_text())["lengths"] == got.tolist() and np.all(np.diff(got) > 0)


def test_an_evaluations_kept_benchmark_and_its_results(tmp_path, monkeypatch):
    events = record_io(monkeypatch)
    result = {"name": "X", "format": "columns", "path": "/data/X", "num_rows": 1,
              "metrics": {"num_scored": 1, "greedy_accuracy": 1.0}, "verifiers": {"choice": 1},
              "bad_records": {"num_bad_records": 0, "by_category": {}, "records": []},
              "rows": [{"index": 0, "greedy": "B", "greedy_score": 1.0}]}
    kept = evaluate_benchmarks_kept(tmp_path, ["X"], ["fp"], lambda i: result, is_main=True)
    assert kept == [result]
    assert_durable(events, tmp_path / PARTIAL_DIR / "X.json")
    del events[:]
    path = write_eval_results(tmp_path, kept, {"model": "m"})
    for final in (tmp_path / "eval_predictions" / "X.jsonl", tmp_path / "eval_results.md", path):
        assert_durable(events, final)
    assert json.loads(path.read_text())["benchmarks"]["X"]["metrics"]["greedy_accuracy"] == 1.0


def test_the_metrics_file_cut_back_at_a_resume(tmp_path, monkeypatch):
    path = tmp_path / "metrics_train.csv"
    path.write_text("step,loss\n1,2.0\n2,1.5\n3,1.2\n")
    events = record_io(monkeypatch)
    assert _CsvSink(path).drop_after(1) == 2
    assert_durable(events, path)
    assert path.read_text().splitlines() == ["step,loss", "1,2.0"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("old")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_file_durably(path, fail)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]
