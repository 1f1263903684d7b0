"""The DPO and reward-model benchmarks against TRL (benchmarks/trl_dpo.py, trl_reward.py) run end to end with --quick
on the CPU, and both sides train the same thing: on the same tiny model and pairs, the first steps' losses (and DPO's
summed log-probs) of TRL's trainer and of our step agree to float32 tolerance. No timing is asserted. One child
interpreter runs both scripts (via runpy, as `python <script> --quick` would) to pay the torch / transformers / trl
imports once; skipped without trl."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"

DRIVER = """
import runpy, sys
sys.path.insert(0, {bench_dir!r})
for script, args in {runs!r}:
    sys.argv = [script, "--quick", *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # each script ends with sys.exit(main())
        if e.code:
            raise
"""


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed")
def test_trl_dpo_and_reward_benches_run_quick_with_equal_losses(tmp_path):
    dpo_json, reward_json = tmp_path / "dpo.json", tmp_path / "reward.json"
    small = ["--hidden", "64", "--layers", "2", "--prompt-len", "8", "24", "--response-len", "4", "16"]
    runs = [(str(BENCH_DIR / "trl_dpo.py"), [*small, "--json", str(dpo_json)]),
            (str(BENCH_DIR / "trl_reward.py"), [*small, "--json", str(reward_json)])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(BENCH_DIR.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(bench_dir=str(BENCH_DIR), runs=runs)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dpo, reward = json.loads(dpo_json.read_text()), json.loads(reward_json.read_text())
    for result in (dpo, reward):
        assert result["ratio_median"] > 0 and all(r["min_s"] > 0 for r in result["rows"])
        trl, ours = result["first_steps"]["trl"], result["first_steps"]["ours"]
        assert len(trl) == len(ours) == 3  # warm-up 1 + 2 rounds: three steps each
        for t, o in zip(trl, ours):  # the same model, pairs and update: the same losses, step after step
            assert o["loss"] == pytest.approx(t["loss"], rel=1e-4, abs=1e-6)
        assert trl[2]["loss"] != pytest.approx(trl[0]["loss"], abs=1e-6)  # the steps trained: not one value thrice
    for t, o in zip(dpo["first_steps"]["trl"], dpo["first_steps"]["ours"]):
        for key in ("logps/chosen", "logps/rejected"):
            assert o[key] == pytest.approx(t[key], rel=1e-5), key
    assert dpo["first_steps"]["trl"][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # policy == reference at step 1
