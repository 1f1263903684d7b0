"""Helpers to run whole jobs through launch/pretrain_vlm.py (one process or torchrun) in tests."""
from __future__ import annotations

import csv
import io
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.unit.launch_in_process import capture_main
from tests.unit.launch_scripts import import_launch_script

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


def run_job_here(overrides: list[str], *, config: Path = DEMO, check: bool = True) -> subprocess.CompletedProcess:
    """`run_job` with one process, run in this one: the launcher's `main` with the same arguments, its exit code
    (a `SystemExit`'s code; 1 and the traceback on stderr for an uncaught exception, as `runner.run_entry` does) and
    what it wrote on stdout / stderr (its log records in the launcher's format).

    Why: a new interpreter spends seconds importing torch, transformers and torch._dynamo before the job's first
    line, more than a tiny job's steps. For tests whose subject is the job, not the process (its signals, kill -9,
    torchrun, the exit status the OS reports): those keep `run_job`. Torch runs on one thread here as a rank
    does under `run_job` (OMP_NUM_THREADS=1), so runs of either kind compare bit for bit; the thread count, the
    log level, the signal handlers the job installs, the kernel choices it makes the process default and the
    working folder are put back afterwards."""
    import torch

    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    entry = import_launch_script("pretrain_vlm")
    argv = ["--config", str(config)] + [x for o in overrides for x in ("--set", o)]
    err = io.StringIO()  # stderr and the job's log records, in the order written
    handler = logging.StreamHandler(err)  # present before `main`, so that its logging.basicConfig adds none
    handler.setFormatter(logging.Formatter("%(asctime)s [rank0] %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    root, level, threads = logging.getLogger(), logging.getLogger().level, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    kernel_choices = dict(DEFAULT_REGISTRY.forced)  # the job applies its [kernels] section as the process default
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    torch.set_num_threads(1)
    try:
        ran = capture_main(entry.main, argv, crash_exits_1=True, err=err)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)
        DEFAULT_REGISTRY.restore(kernel_choices)
        for s, h in handlers.items():
            signal.signal(s, h)
    r = subprocess.CompletedProcess(["pretrain_vlm.main", *argv], ran.returncode, ran.stdout, ran.stderr)
    if check and r.returncode != 0:
        raise AssertionError(f"job failed ({r.returncode}):\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-8000:]}")
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
