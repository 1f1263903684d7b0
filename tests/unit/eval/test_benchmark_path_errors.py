"""An eval benchmark whose files cannot be read as a whole is a config error naming its key (exit 2).

Found by evaluation jobs: a benchmark path with no file there, a .parquet that is not a parquet table
and a file without the format's columns each ended the job with a traceback and exit 1 — after the
benchmarks listed before it had been scored. `open_benchmark` now raises ConfigError starting with
the key it is given, and the job opens every benchmark before scoring the first (jobs.run_eval).
"""
from __future__ import annotations

import json

import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.errors import ConfigError
from megatron_vlm.eval.benchmarks import open_benchmark


@pytest.mark.parametrize("case, fmt, expect", [
    ("missing", "messages", r"no \.jsonl / \.json data files at .*nope\.jsonl"),
    ("missing", "geometry3k", r"no \.parquet / \.arrow / \.jsonl / \.json data files at .*nope\.jsonl"),
    ("corrupt", "geometry3k", r".*bad\.parquet: cannot be read as a \.parquet table \(ArrowInvalid"),
    ("columns", "geometry3k", r".*cols\.jsonl has no column\(s\) \['answer', 'problem'\] for format 'geometry3k'"),
])
def test_unreadable_benchmark_names_its_key(tmp_path, case, fmt, expect):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\x00" * 64)
    (tmp_path / "cols.jsonl").write_text(json.dumps({"q": "x", "a": "1", "images": []}) + "\n")
    path = {"missing": tmp_path / "nope.jsonl", "corrupt": tmp_path / "bad.parquet", "columns": tmp_path / "cols.jsonl"}[case]
    cfg = BenchmarkConfig(name="b", path=str(path), format=fmt)
    with pytest.raises(ConfigError, match=rf"^eval\.benchmarks\[2\]\.path: {expect}"):
        open_benchmark(cfg, template="{problem}", key="eval.benchmarks[2].path")
