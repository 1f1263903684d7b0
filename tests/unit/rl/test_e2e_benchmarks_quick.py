"""The GRPO / rollout benchmarks run end to end with --quick on the CPU (tiny model): the scripts stay
runnable in CI. No timing is asserted (wall-clock on a shared CI machine is noise); the rollout benchmark's own check that
transformers holds the same weights as our engine (equal logits) is. One child interpreter runs both
scripts (via runpy, as `python <script> --quick` would) to pay the torch / transformers import once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "e2e"

DRIVER = """
import runpy, sys
sys.path.insert(0, {bench_dir!r})
for script, args in {runs!r}:
    sys.argv = [script, "--quick", *args]
    runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.heavy
def test_e2e_benchmarks_run_quick(tmp_path):
    rollout_json, step_json = tmp_path / "rollout.json", tmp_path / "step.json"
    runs = [("bench_rollout.py", ["--repeats", "1", "--json", str(rollout_json)]),
            ("bench_grpo_step.py", ["--steps", "1", "--kl", "0.1", "--json", str(step_json)])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(bench_dir=str(BENCH_DIR), runs=runs)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=BENCH_DIR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rollout = json.loads(rollout_json.read_text())
    assert set(rollout["results"]) == {"ours_shared_prefix", "ours_no_sharing", "transformers_generate", "weight_refresh"}
    assert all(r["tokens_per_s"] > 0 for k, r in rollout["results"].items() if k != "weight_refresh")
    assert rollout["meta"]["max_logit_diff_vs_transformers"] < 1e-4
    step = json.loads(step_json.read_text())["summary"]
    for key in ("time/rollout_s", "time/train_s", "time/ref_s", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"):
        assert step[key] > 0, key
