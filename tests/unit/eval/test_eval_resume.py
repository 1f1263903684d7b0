"""An evaluation job stopped in its third benchmark (SLURM preemption: exit 143, no results) keeps the two it
finished: the job run again in its folder with the same settings, model and data files scores only the rest, and
its results equal those of one uninterrupted job. A changed setting, model file, data file or image a row names
scores the benchmark again; a finished job leaves nothing to reuse. The model, engine and scoring are stand-ins (the evaluation itself
is covered by the other tests of this folder)."""
from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm import jobs
from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.data.config import DataConfig
from megatron_vlm.eval.report import clear_eval_results, write_eval_results
from megatron_vlm.eval.resume import PARTIAL_DIR
from megatron_vlm.training.signals import StopRequested
from tests.unit.eval.bench_harness import write_messages

NAMES = ("a", "b", "c")


class Stand:
    """The heavy parts of `jobs._evaluate_benchmarks` as stand-ins; `stop_at`: the benchmark whose evaluation the
    stop signal interrupts."""

    def __init__(self, monkeypatch, stop_at=None):
        self.evaluated, self.stop_at = [], stop_at
        monkeypatch.setattr(jobs, "build_model_bundle", lambda ctx: NS(model=None, layer_kinds=()))
        monkeypatch.setattr(jobs, "check_moe_section", lambda *a: None)
        monkeypatch.setattr(jobs, "answer_engine", lambda ctx, bundle: None)
        monkeypatch.setattr(jobs, "VerifierScorer", lambda ecfg: NS(close=lambda: None))
        monkeypatch.setattr(jobs, "evaluate_benchmark", self.evaluate)

    def evaluate(self, ctx, bundle, engine, bench, scorer, *, bench_index):
        if bench.name == self.stop_at:
            raise StopRequested(signal.SIGTERM)
        self.evaluated.append(bench.name)
        return {"name": bench.name, "format": "messages", "path": bench.path, "num_rows": 1,
                "metrics": {"num_scored": 1, "greedy_accuracy": 0.25 * (bench_index + 1)}, "verifiers": {"short_answer": 1},
                "verifier_failures": {"timeouts": 0, "errors": 0, "reasoning_unclosed": 0},
                "bad_records": {"num_bad_records": 0, "num_skips": 0, "by_category": {}, "records": []},
                "rows": [{"index": 0, "greedy": "red", "greedy_score": 1.0}]}


def _ctx(tmp_path, *, model, max_new_tokens=4):
    benches = [BenchmarkConfig(name=n, path=str(tmp_path / f"{n}.jsonl"), format="messages") for n in NAMES]
    cfg = NS(eval=EvalConfig(benchmarks=benches, max_new_tokens=max_new_tokens), data=DataConfig(max_tokens_per_pack=512),
             model=NS(path=str(model), dtype="float32"), train=NS(seed=0, precision="fp32"), parallel=NS(), kernels=NS())
    return NS(cfg=cfg, run_dir=tmp_path / "run", env=NS(rank=0, world_size=1, is_main=True, device=torch.device("cpu")))


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "eval_settings", lambda cfg, world: {"max_new_tokens": cfg.eval.max_new_tokens,
                                                                     "benchmarks": {b.name: {"path": b.path} for b in cfg.eval.benchmarks}})
    for n in NAMES:
        write_messages(tmp_path / f"{n}.jsonl", [(None, f"question {n}", "red")])
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "run").mkdir()
    return tmp_path, model


def test_a_stopped_evaluation_keeps_the_benchmarks_it_finished(folder, monkeypatch):
    tmp_path, model = folder
    first = Stand(monkeypatch, stop_at="c")
    with pytest.raises(StopRequested):
        jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert first.evaluated == ["a", "b"]
    again = Stand(monkeypatch)
    results = jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert again.evaluated == ["c"]  # a and b kept from the stopped job
    straight = Stand(monkeypatch)
    clear = tmp_path / "straight"
    clear.mkdir()
    ctx = _ctx(tmp_path, model=model)
    ctx.run_dir = clear
    assert results == jobs._evaluate_benchmarks(ctx) and straight.evaluated == list(NAMES)
    write_eval_results(tmp_path / "run", results, {"model": str(model)})
    assert not (tmp_path / "run" / PARTIAL_DIR).exists()  # a finished job leaves nothing to reuse
    rerun = Stand(monkeypatch)
    jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert rerun.evaluated == list(NAMES)


@pytest.mark.parametrize("change", ["setting", "model file", "data file"])
def test_a_kept_benchmark_is_scored_again_when_what_it_depends_on_changed(folder, monkeypatch, change):
    tmp_path, model = folder
    Stand(monkeypatch, stop_at="c")
    with pytest.raises(StopRequested):
        jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    kw = {}
    if change == "setting":
        kw["max_new_tokens"] = 8
    elif change == "model file":
        (model / "model.safetensors").write_bytes(b"other weights")
    else:
        write_messages(tmp_path / "b.jsonl", [(None, "question b, edited", "red")])
    again = Stand(monkeypatch)
    jobs._evaluate_benchmarks(_ctx(tmp_path, model=model, **kw))
    assert again.evaluated == (["b", "c"] if change == "data file" else list(NAMES))


def test_clearing_a_start_keeps_the_partial_results_and_an_unreadable_one_is_scored_again(folder, monkeypatch):
    tmp_path, model = folder
    Stand(monkeypatch, stop_at="b")
    with pytest.raises(StopRequested):
        jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    partial = tmp_path / "run" / PARTIAL_DIR / "a.json"
    clear_eval_results(tmp_path / "run")
    assert json.loads(partial.read_text())["result"]["name"] == "a"
    partial.write_text("{not json")
    os.utime(partial)
    again = Stand(monkeypatch)
    jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert again.evaluated == list(NAMES)


@pytest.mark.parametrize("edited", ["image", "video frame"])
def test_a_kept_benchmark_is_scored_again_when_an_image_it_names_changed(folder, monkeypatch, edited):
    """The benchmark's rows name their image (a video's frames) by path: an edited image with the data file
    untouched gave the kept result of the old one."""
    tmp_path, model = folder
    (tmp_path / "b.png").write_bytes(b"old pixels")
    (tmp_path / "frames").mkdir()
    for k in range(2):
        (tmp_path / "frames" / f"{k}.png").write_bytes(b"old frame")
    user = [{"type": "image", "image": "b.png"}, {"type": "video", "video": "frames"},
            {"type": "text", "text": "question b"}]
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": user},
                                                               {"role": "assistant", "content": "red"}]}) + "\n")
    Stand(monkeypatch, stop_at="c")
    with pytest.raises(StopRequested):
        jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    unchanged = Stand(monkeypatch, stop_at="c")  # nothing edited: b is kept
    with pytest.raises(StopRequested):
        jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert unchanged.evaluated == []
    (tmp_path / ("b.png" if edited == "image" else "frames/1.png")).write_bytes(b"new pixels, other size")
    again = Stand(monkeypatch)
    jobs._evaluate_benchmarks(_ctx(tmp_path, model=model))
    assert again.evaluated == ["b", "c"]


def test_only_local_files_a_row_names_are_signed(tmp_path):
    """Embedded images are part of the data file's signature and a remote URL has no local file to sign; a table's
    Image struct without bytes names its file; a missing file is signed as missing (it appears: scored again)."""
    from megatron_vlm.data.messages import Record
    from megatron_vlm.data.sources import ListRecords
    from megatron_vlm.eval.resume import media_signatures

    (tmp_path / "x.png").write_bytes(b"12345")
    items = [{"type": "image", "image": b"\x89PNG"}, {"type": "image", "image": "https://example.org/a.png"},
             {"type": "image", "image": {"bytes": b"\x89PNG", "path": "in_table.png"}},
             {"type": "image", "image": {"bytes": None, "path": str(tmp_path / "x.png")}},
             {"type": "video", "video": [str(tmp_path / "x.png"), str(tmp_path / "gone.png")]}]
    rec = Record([{"role": "user", "content": items}, {"role": "assistant", "content": "a"}], "t", 1, {})
    sigs = media_signatures(ListRecords("t", [rec]))
    assert [(s["file"], s.get("size"), s.get("missing")) for s in sigs] == [
        (str(tmp_path / "gone.png"), None, True), (str((tmp_path / "x.png").resolve()), 5, None)]
