"""Helpers to run whole jobs through launch/pretrain_vlm.py (one process or torchrun) in tests."""
from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "launch" / "pretrain_vlm.py"
DEMO = REPO / "launch" / "configs" / "demo_sft.toml"
FAULT_ENTRY = REPO / "tests" / "integration" / "fault_entry.py"
"""Used instead of ENTRY when a test sets MEGATRON_VLM_FAULT_KILL_AT_STEP or _RAISE_AT_STEP (the hook lives in the tests)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merged_sets(base: dict, extra: dict) -> dict[str, str]:
    """`base` updated with `extra`, less the base's keys that `extra` leaves idle (refused beside it): a job that
    writes no checkpoint (`checkpoint.enable` false) drops the checkpoint cadence and retention, one that reads its
    own files (`data.type` not "synthetic_vqa") the `data.synthetic_*` keys."""
    sets = {k: str(v) for k, v in {**base, **extra}.items()}
    idle = []
    if sets.get("checkpoint.enable", "").lower() == "false":
        idle += ["checkpoint.every_steps", "checkpoint.keep_last"]
    if sets.get("data.type", "synthetic_vqa").strip("\"'") != "synthetic_vqa":
        idle += [k for k in sets if k.startswith("data.synthetic_")]
    for key in idle:
        if key not in extra:
            sets.pop(key, None)
    return sets


def as_overrides(base: dict, extra: dict) -> list[str]:
    """`merged_sets` as `--set` items."""
    return [f"{k}={v}" for k, v in merged_sets(base, extra).items()]


def small_demo_overrides(tmp: Path, assets: Path, **extra) -> list[str]:
    """The demo config shrunk to seconds: few steps, few samples, shared tiny assets."""
    sets = {
        "model.path": f'"{assets / "model"}"',
        "data.synthetic_dir": f'"{assets / "data"}"',
        "data.synthetic_train_size": "64",
        "data.synthetic_eval_size": "8",
        "data.max_tokens_per_pack": "256",
        "data.num_workers": "0",
        "train.output_dir": f'"{tmp}"',
        "train.max_steps": "4",
        "train.eval_every": "0",
        "train.log_every": "1",
        "checkpoint.every_steps": "2",
        "checkpoint.keep_last": "2",
        "logging.tensorboard": "false",
    }
    return as_overrides(sets, extra)


def run_job(overrides: list[str], *, nproc: int = 1, env: dict | None = None, config: Path = DEMO,
            timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    args = []
    for o in overrides:
        args += ["--set", o]
    # a crashed process prints its native frames and every thread's Python frames (to diagnose a rare crash in CI)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "MEGATRON_VLM_SEGV_BACKTRACE": "1",
                **(env or {})}
    faults = ("MEGATRON_VLM_FAULT_KILL_AT_STEP", "MEGATRON_VLM_FAULT_RAISE_AT_STEP", "MEGATRON_VLM_FAULT_TERM_AT_STEP")
    entry = FAULT_ENTRY if any(full_env.get(k) for k in faults) else ENTRY
    if nproc == 1:
        cmd = [sys.executable, str(entry), "--config", str(config), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(entry), "--config", str(config), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(REPO))
    if check and r.returncode != 0:
        crash = r.stderr.find("Fatal Python error")  # a crashed rank's frames, which the other ranks' output follows
        frames = f"\nCRASH:\n{r.stderr[max(0, crash - 3000):crash + 6000]}" if crash >= 0 else ""
        raise AssertionError(f"job failed ({r.returncode}):\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-8000:]}{frames}")
    return r


def read_metrics(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def load_safetensors_dir(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
