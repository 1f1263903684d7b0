"""An evaluation rerun into a folder that holds an earlier run's results: the earlier summary is gone as soon
as the new job starts, so a job that stops early (here: a benchmark that does not open, exit 2) never leaves
the old eval_results.json beside its own eval_config.toml, looking like its result."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from jobs import REPO


def test_rerun_that_stops_early_leaves_no_earlier_results(tmp_path):
    pq.write_table(pa.table({"prompt": ["What is 1+1?"], "solution": ["2"]}), tmp_path / "wrong_columns.parquet")
    out = tmp_path / "eval"
    (out / "eval_predictions").mkdir(parents=True)
    (out / "eval_results.json").write_text(json.dumps({"settings": {"model": "an earlier model"}, "benchmarks": {}}))
    (out / "eval_results.md").write_text("# Evaluation of an earlier model\n")
    (out / "eval_predictions" / "old.jsonl").write_text("{}\n")
    cfg = tmp_path / "eval.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "model"}"\nsynthesize = "tiny_qwen2_5_vl"\n[data]\nmax_tokens_per_pack = 256\n'
                   f'num_workers = 0\n[train]\nmode = "eval"\noutput_dir = "{out}"\n[eval]\nmax_new_tokens = 4\n'
                   f'[[eval.benchmarks]]\nname = "a"\npath = "{tmp_path / "wrong_columns.parquet"}"\nformat = "mathvista"\n')
    r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(cfg)], capture_output=True,
                       text=True, timeout=300, cwd=str(REPO), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "eval.benchmarks[0].path" in r.stderr.strip().splitlines()[-1]
    assert (out / "eval_config.toml").exists()
    assert not (out / "eval_results.json").exists() and not (out / "eval_results.md").exists()
    assert not (out / "eval_predictions").exists()
