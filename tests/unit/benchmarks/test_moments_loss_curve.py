"""benchmarks/e2e/moments_loss_curve.py (loss curves with fp32 / bf16 / bf16-nearest AdamW moments) runs end to end
at a tiny size on the CPU: every variant trains and reports its differences from fp32, the losses are finite, and an
unknown variant exits 2 naming --variants."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "e2e" / "moments_loss_curve.py"


def test_moments_loss_curve_runs_every_variant(tmp_path):
    out = tmp_path / "curve.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--hidden", "64", "--layers", "1", "--vocab",
                           "256", "--tokens", "128", "--variants", "fp32,bf16,bf16_nearest", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["curves"]) == {"fp32", "bf16", "bf16_nearest"}
    assert all(len(c) == 4 and all(x == x and x > 0 for x in c) for c in data["curves"].values())
    assert {"final_abs_diff", "max_abs_diff", "within_tolerance"} <= set(data["results"]["bf16"])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--hidden", "64", "--layers", "1", "--vocab",
                           "256", "--tokens", "128", "--variants", "fp32,bad"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and "--variants" in proc.stderr
