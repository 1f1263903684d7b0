"""benchmarks/gpu_wave3.sh's section list, run on the CPU with fake `python3` / `nvidia-smi` (nothing is measured).

A GPU lease is 15 minutes in all: a mistyped section name (`decode-32`, `sft16K`) must stop the command at once
with the names it knows, not run the other sections and come back without the one the lease was for.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _copy(tmp_path: Path) -> tuple[Path, dict]:
    """The script in a scratch repository (it cds to its parent's parent and links megatron_vlm/kernels there),
    with fake executables that record their arguments."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "megatron_vlm").mkdir()
    shutil.copy(REPO / "benchmarks" / "gpu_wave3.sh", tmp_path / "benchmarks" / "gpu_wave3.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "nvidia-smi", "cuda-gdb"):
        exe = bin_dir / name
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls.txt"\n')
        exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "W3_DIR": str(tmp_path / "w3")}
    return tmp_path / "benchmarks" / "gpu_wave3.sh", env


def test_an_unknown_section_is_refused_before_anything_runs(tmp_path):
    script, env = _copy(tmp_path)
    r = subprocess.run(["bash", str(script), "decode", "decode-32"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "decode-32" in r.stderr and "decode32" in r.stderr  # the typo and the names it knows
    assert not (tmp_path / "calls.txt").exists()  # no step (and no nvidia-smi) ran


def test_known_sections_run_their_steps_only(tmp_path):
    script, env = _copy(tmp_path)
    r = subprocess.run(["bash", str(script), "decode_attn"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.txt").read_text()
    assert "benchmarks/kernels/bench_decode_attention.py --json" in calls
    assert "bench_train_step" not in calls and "profile_decode" not in calls
    steps = (tmp_path / "w3" / "steps.txt").read_text()
    assert steps.startswith("decode_attention_bench: exit 0")
