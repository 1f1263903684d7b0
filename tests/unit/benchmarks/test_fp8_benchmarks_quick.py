"""The fp8 benchmarks (bench_fp8.py: bf16 vs fp8 SFT step; fp8_loss_curve.py: bf16 vs fp8 loss curves) run
end to end with --quick on the CPU (tiny model, torchao's emulated float8): the scripts the GPU lease runs stay
runnable in CI. No timing is asserted; what is checked is that every variant ran, the float8 layers were
there, and the emulated fp8 losses stay near bf16. One child interpreter runs both scripts (via runpy, as
`python <script> --quick` would) to pay the torch / transformers / torchao imports once."""
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
def test_fp8_benchmarks_run_quick(tmp_path):
    step_json, curve_json = tmp_path / "step.json", tmp_path / "curve.json"
    prof = tmp_path / "prof"
    runs = [("bench_fp8.py", ["--rounds", "2", "--steps", "1", "--warmup", "1", "--profile", str(prof), "--json", str(step_json)]),
            ("fp8_loss_curve.py", ["--steps", "12", "--json", str(curve_json)])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(bench_dir=str(BENCH_DIR), runs=runs)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=BENCH_DIR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = json.loads(step_json.read_text())
    assert step["meta"]["fp8_linear_layers"] == 14 and step["meta"]["quick"]
    assert set(step["results"]) == {"bf16", "tensorwise", "rowwise"}
    scaling_ms = {}  # one profiled step per variant: the float8 scaling (amax, casts) shows in fp8's
    for v in ("bf16", "tensorwise", "rowwise"):
        cats = json.loads((tmp_path / f"prof_{v}.json").read_text())["categories"]
        scaling_ms[v] = cats.get("fp8 scaling (amax, casts)", {"ms": 0.0})["ms"]
    assert min(scaling_ms["tensorwise"], scaling_ms["rowwise"]) > 10 * scaling_ms["bf16"], scaling_ms
    for v, r in step["results"].items():
        assert r["step_s_min"] > 0 and r["tokens_per_s"] > 0, v
        if v != "bf16":
            assert r["time_ratio_vs_bf16_median"] > 0
            # the same weights and batch at warm-up: the float8 variants' losses sit near bf16's
            assert abs(r["warmup_loss"] - step["results"]["bf16"]["warmup_loss"]) < 0.05
    curve = json.loads(curve_json.read_text())
    assert set(curve["curves"]) == {"bf16", "tensorwise", "rowwise"}
    assert all(len(c) == 12 for c in curve["curves"].values())
    for v in ("tensorwise", "rowwise"):
        r = curve["results"][v]
        assert r["within_tolerance"] and r["max_abs_diff"] > 0  # close to bf16, and not the bf16 run again
    base = curve["curves"]["bf16"]
    assert base[-1] < base[0]  # it learns
