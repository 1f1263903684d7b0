"""A benchmark row that is skipped is one skip of that benchmark, whatever decoding passes met it.

The greedy pass and the sampled pass each read the benchmark through the eval loader, and a row that fails
while the loader processes it (an image whose header reads and whose pixels do not) was logged by both: its
`skips` said 2 and the benchmark's `num_skips` counted it twice. The results now count each skipped row once
(`num_skips` = rows skipped) and say per pass how many rows it could not score (`skipped_by_mode`)."""
from __future__ import annotations

import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig
from tests.unit.eval.bench_harness import evaluate, write_messages, write_png


def _bench(tmp_path) -> BenchmarkConfig:
    write_png(tmp_path / "ok.png")
    write_png(tmp_path / "cut.png", truncated=True)
    path = write_messages(tmp_path / "b.jsonl", [("ok.png", "What colour?", "red"), ("cut.png", "What colour?", "red"),
                                                 (None, "What colour is red?", "red"),
                                                 ("missing.png", "What colour?", "red")])
    return BenchmarkConfig(name="b", path=str(path), format="messages")


def test_a_row_skipped_by_both_passes_is_one_skip(tmp_path, proc):
    res = evaluate(proc, _bench(tmp_path), samples=2)
    bad = res["bad_records"]
    assert sorted((r["index"], r["category"]) for r in bad["records"]) == [(2, "corrupt_image"), (4, "missing_image")]
    assert [r["skips"] for r in bad["records"]] == [1, 1]
    assert bad["num_skips"] == bad["num_bad_records"] == 2
    assert bad["skipped_by_mode"] == {"greedy": 2, "samples": 2}
    assert res["metrics"]["num_scored"] == 2 and res["metrics"]["greedy_accuracy"] == 1.0


def test_one_pass_counts_its_skips(tmp_path, proc):
    res = evaluate(proc, _bench(tmp_path))
    bad = res["bad_records"]
    assert bad["num_skips"] == 2 and bad["skipped_by_mode"] == {"greedy": 2}


def _two_ranks(tmp, rank: int) -> None:
    from megatron_vlm.data.processor import load_processor

    bench = BenchmarkConfig(name="b", path=str(tmp / "b.jsonl"), format="messages")
    res = evaluate(load_processor(tmp / "proc"), bench, rank=rank, world=2, samples=2)
    bad = res["bad_records"]
    # the same counts as one process: each bad row once, whichever rank planned or processed it
    assert sorted((r["index"], r["category"], r["skips"]) for r in bad["records"]) == [
        (2, "corrupt_image", 1), (4, "missing_image", 1)], bad
    assert bad["num_skips"] == 2 and bad["skipped_by_mode"] == {"greedy": 2, "samples": 2}
    assert res["metrics"]["num_scored"] == 2 and [r["index"] for r in res["rows"]] == [0, 2]


@pytest.mark.heavy  # ~20 s on the 2-core machine: two spawned ranks import the evaluation stack
@pytest.mark.distributed
def test_two_ranks_count_as_one(tmp_path):
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor
    from tests.integration.parallel.spawn import spawn

    build_tiny_qwen2_5_vl_processor(tmp_path / "proc")
    _bench(tmp_path)
    spawn(tmp_path, _two_ranks)


def test_rows_are_the_scored_and_the_bad_ones(tmp_path, proc):
    """`num_rows` counted the rows the files' reader kept, leaving out the lines refused when the benchmark was
    opened (malformed JSON, a reference with nothing in it) that `bad_records` lists: rows 2, scored 2, bad 2."""
    write_png(tmp_path / "ok.png")
    path = write_messages(tmp_path / "b.jsonl", [("ok.png", "What colour?", "red"), (None, "What colour is red?", "."),
                                                 (None, "What colour is red?", "red")])
    path.write_text(path.read_text() + "{not json\n")
    res = evaluate(proc, BenchmarkConfig(name="b", path=str(path), format="messages"))
    assert (res["num_rows"], res["metrics"]["num_scored"], res["bad_records"]["num_bad_records"]) == (4, 2, 2)
