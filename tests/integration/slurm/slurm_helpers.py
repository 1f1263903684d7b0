"""Shared pieces of the Slurm launcher tests: script paths, the training job they launch, dry runs.

`TrainJob` describes what train.sbatch starts in these tests: the entry point, a config file and
the `--set` overrides of a short run, and how to read the final parameters from a run folder.
"""
from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
TRAIN_SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
BENCH_SBATCH = REPO / "launch" / "slurm" / "bench_kernels.sbatch"
STANDIN = Path(__file__).resolve().parent / "standin_train.py"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without an outer Slurm job's variables (CI may run inside one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["TORCHRUN"] = f"{sys.executable} -m torch.distributed.run"
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


class TrainJob:
    """The stand-in trainer: a tiny MLP with the entry point's run-folder and SIGTERM contract."""

    entry_point = STANDIN

    def __init__(self, folder: Path, *, max_steps: int = 6, step_seconds: float = 0.0, global_batch_size: int = 8):
        self.config = folder / "job.toml"
        self.config.write_text(
            f"[train]\nmax_steps = {max_steps}\nseed = 3\nglobal_batch_size = {global_batch_size}\n"
            f"[standin]\nstep_seconds = {step_seconds}\n"
        )
        self.max_steps = max_steps

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "ENTRY_POINT": str(self.entry_point)}

    def run_direct(self, output_dir: Path, *, timeout: float = 120) -> None:
        """The same job without Slurm or torchrun: one plain Python process."""
        cmd = [sys.executable, str(self.entry_point), "--config", str(self.config),
               "--set", f'train.output_dir="{output_dir}"']
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"

    @staticmethod
    def checkpoint_steps(run_dir: Path) -> list[int]:
        root = run_dir / "checkpoints"
        return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMPLETE").is_file())

    def final_params(self, run_dir: Path) -> dict[str, torch.Tensor]:
        steps = self.checkpoint_steps(run_dir)
        assert steps and steps[-1] == self.max_steps, f"{run_dir}: complete checkpoints {steps}, want {self.max_steps}"
        return torch.load(run_dir / "checkpoints" / f"step_{steps[-1]}" / "state.pt", weights_only=True)["model"]

    @staticmethod
    def metric_steps(run_dir: Path) -> list[int]:
        with open(run_dir / "metrics_train.csv", newline="") as f:
            return [int(row["step"]) for row in csv.DictReader(f)]


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, exact: bool) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def dry_run(args: list[str], *, cwd: Path, env: dict[str, str], script: Path = TRAIN_SBATCH) -> tuple[list[str], str]:
    """Run a launcher with DRY_RUN=1; return its command lines (stdout) and its log (stderr)."""
    res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=cwd,
                         env={**env, "DRY_RUN": "1"}, timeout=60)
    assert res.returncode == 0, f"dry run exited {res.returncode}: {res.stderr}"
    return res.stdout.splitlines(), res.stderr


def split_node_line(line: str) -> tuple[str, list[str]]:
    """`cd DIR && cmd ...` -> (DIR, [cmd, ...])."""
    words = shlex.split(line)
    assert words[0] == "cd" and words[2] == "&&", line
    return words[1], words[3:]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def set_values(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def wait_for(cond, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
