"""The result files of an evaluation: re-readable, never mixed with a previous run's, never complete-looking
when the writing stopped part-way."""
from __future__ import annotations

import json

import pytest

from megatron_vlm.eval import report
from megatron_vlm.eval.report import write_eval_results

_BAD = {"num_bad_records": 0, "by_category": {}, "records": []}


def _result(name: str, score: float) -> dict:
    rows = [{"index": 0, "id": "a", "answer": "B", "verifier": "choice", "group": None, "greedy": "B",
             "greedy_score": score}]
    return {"name": name, "format": "columns", "path": f"/data/{name}", "num_rows": 1,
            "metrics": {"num_scored": 1, "greedy_accuracy": score}, "verifiers": {"choice": 1},
            "bad_records": _BAD, "rows": rows}


_SETTINGS = {"model": "m", "greedy": True, "samples": 0}


def test_results_are_rereadable(tmp_path):
    path = write_eval_results(tmp_path, [_result("X", 1.0)], _SETTINGS)
    summary = json.loads(path.read_text())
    assert summary["benchmarks"]["X"]["metrics"] == {"num_scored": 1, "greedy_accuracy": 1.0}
    rows = [json.loads(line) for line in (tmp_path / "eval_predictions" / "X.jsonl").read_text().splitlines()]
    assert rows == _result("X", 1.0)["rows"]


def test_rerun_into_the_same_folder_leaves_no_predictions_of_the_first(tmp_path):
    write_eval_results(tmp_path, [_result("X", 1.0), _result("Y", 0.0)], _SETTINGS)
    write_eval_results(tmp_path, [_result("X", 0.0)], _SETTINGS)
    assert sorted(p.name for p in (tmp_path / "eval_predictions").iterdir()) == ["X.jsonl"]
    assert list(json.loads((tmp_path / "eval_results.json").read_text())["benchmarks"]) == ["X"]


def test_writing_stopped_part_way_leaves_no_results_file(tmp_path, monkeypatch):
    write_eval_results(tmp_path, [_result("X", 1.0)], _SETTINGS)  # a previous run's complete results
    real = report.write_text_durably

    def dies_on_predictions(path, text):
        if path.parent.name == "eval_predictions":
            raise KeyboardInterrupt  # the job killed while writing
        real(path, text)

    monkeypatch.setattr(report, "write_text_durably", dies_on_predictions)
    with pytest.raises(KeyboardInterrupt):
        write_eval_results(tmp_path, [_result("X", 0.0)], _SETTINGS)
    # neither the new summary over the old predictions nor the old summary beside a half-written run
    assert not (tmp_path / "eval_results.json").exists()
    assert not (tmp_path / "eval_results.md").exists()


def test_clear_eval_results_removes_a_previous_run(tmp_path):
    write_eval_results(tmp_path, [_result("X", 1.0)], _SETTINGS)
    (tmp_path / "other.txt").write_text("kept")
    report.clear_eval_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt"]
