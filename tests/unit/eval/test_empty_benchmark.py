"""An empty benchmark file (a valid table with its columns and no rows) is a benchmark with 0 rows, reported
like one whose rows are all bad, not "cannot be read" (which stopped every other benchmark of the job)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.eval.benchmarks import open_benchmark


def _cfg(path) -> BenchmarkConfig:
    return BenchmarkConfig(name="e", path=str(path), format="columns", columns={"question": "q", "answer": "a"})


def test_empty_parquet_is_a_benchmark_with_no_rows(tmp_path):
    pq.write_table(pa.table({"q": pa.array([], pa.string()), "a": pa.array([], pa.string())}), tmp_path / "e.parquet")
    assert len(open_benchmark(_cfg(tmp_path / "e.parquet"), template="{problem}").source) == 0


def test_empty_parquet_beside_a_full_one_keeps_the_rows(tmp_path):
    pq.write_table(pa.table({"q": pa.array([], pa.string()), "a": pa.array([], pa.string())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"q": ["What is 1+1?", "What is 2+2?"], "a": ["2", "4"]}), tmp_path / "b.parquet")
    src = open_benchmark(_cfg(tmp_path), template="{problem}").source
    assert len(src) == 2 and src.get(1).meta["answer"] == "4" and src.locate(1)[1] == 1


def test_max_samples_takes_the_first_rows_bad_ones_included(tmp_path):
    import pytest

    from megatron_vlm.data.bad_records import BadRecordError
    pq.write_table(pa.table({"q": ["", "What is 2+2?", "What is 3+3?"], "a": ["2", "4", "6"]}), tmp_path / "b.parquet")
    cfg = _cfg(tmp_path / "b.parquet")
    cfg.max_samples = 2
    src = open_benchmark(cfg, template="{problem}").source
    assert len(src) == 2 and src.get(1).meta["answer"] == "4"
    with pytest.raises(BadRecordError):  # row 0 is skipped and counted; row 2 does not take its place
        src.get(0)
