"""benchmarks/e2e/bench_host_overhead.py at one decoder layer and one vision block: it runs the job's SFT step
(FSDP2, selective checkpointing, the DTensor gradients' clip, the guard, the loop), times its phases, and counts
the host reads of device values per step by call site. The step's own code (training/sft.py, training/loop.py,
the collectives, the clip) reads the device once per step, for the guard; what else reads is the model's (its
vision / packing bookkeeping and the label selection of the loss), listed in benchmarks/RESULTS.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_one_layer_run_reports_phases_and_one_step_read(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "e2e" / "bench_host_overhead.py"), "--layers", "1",
           "--vision-depth", "1", "--steps", "1", "--warmup", "1", "--count-reads", "--phases", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step_ms_min"] > 0 and "backward" in result["phases"]["ms_per_step"]
    for row in ("step without a log row", "step that logs its row"):
        sites = result["host_reads"][row]["sites"]
        step_code = [s for s in sites if s["site"].startswith(("megatron_vlm/training/sft.py", "megatron_vlm/training/loop.py",
                                                               "megatron_vlm/training/step_guard.py", "megatron_vlm/parallel/"))]
        assert [(s["kind"], s["n"]) for s in step_code] == [("tolist", 1)], (row, sites)
        assert "global_loss_and_norm" in step_code[0]["site"]
