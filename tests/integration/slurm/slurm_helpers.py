"""Shared pieces of the Slurm launcher tests: script paths, the training job they launch, dry runs.

`TrainJob` describes what train.sbatch starts in these tests — the real entry point on the demo
config with the `--set` overrides of a short run — and how to read results from a run folder.
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
ENTRY = REPO / "launch" / "pretrain_vlm.py"
DEMO = REPO / "launch" / "configs" / "demo_sft.toml"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without an outer Slurm job's variables (CI may run inside one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["TORCHRUN"] = f"{sys.executable} -m torch.distributed.run"
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


class TrainJob:
    """launch/pretrain_vlm.py on launch/configs/demo_sft.toml, shrunk to seconds with `--set`.

    The tiny model folder and the synthetic data live in `assets` (shared by the tests of a
    session; the first job creates them). `output_dir` is left to the launcher unless given.
    """

    entry_point = ENTRY

    def __init__(self, assets: Path, *, max_steps: int = 6, every_steps: int = 0, output_dir: Path | None = None,
                 tokens_per_pack: int = 512, config: Path = DEMO, extra: tuple[str, ...] = ()):
        self.config = config
        self.max_steps = max_steps
        self.overrides = [
            f'model.path="{assets / "model"}"',
            f'data.synthetic_dir="{assets / "data"}"',
            "data.synthetic_train_size=96",
            "data.synthetic_eval_size=0",  # no evaluation: not what the launcher tests are about
            f"data.max_tokens_per_pack={tokens_per_pack}",
            # in-process loading: quicker for a few packs (loader workers leave Slurm's TERM / USR1 to
            # their rank: tests/unit/data/test_data_loader.py)
            "data.num_workers=0",
            f"train.max_steps={max_steps}",
            "train.eval_every=0",
            "train.log_every=1",
            f"checkpoint.every_steps={every_steps}",
            "checkpoint.keep_last=0",
            "logging.tensorboard=false",
        ]
        self.overrides += list(extra)
        if output_dir is not None:
            self.overrides.append(f'train.output_dir="{output_dir}"')

    def args(self) -> list[str]:
        """What follows the script name: the config, then `--set` overrides."""
        out = [str(self.config)]
        for o in self.overrides:
            out += ["--set", o]
        return out

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "ENTRY_POINT": str(self.entry_point), "OMP_NUM_THREADS": "1"}

    def run_direct(self, output_dir: Path, *, cwd: Path, timeout: float = 300) -> None:
        """The same job without Slurm or torchrun: one plain Python process."""
        cmd = [sys.executable, str(self.entry_point), "--config", *self.args(), "--set", f'train.output_dir="{output_dir}"']
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                             env=self.env(clean_env()))
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"

    @staticmethod
    def checkpoint_steps(run_dir: Path) -> list[int]:
        root = run_dir / "checkpoints"
        return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMPLETE").is_file())

    @staticmethod
    def checkpoint_ranks(run_dir: Path, step: int) -> int:
        """How many processes wrote the checkpoint of `step` (one extra_rank<R>.pt each)."""
        return len(list((run_dir / "checkpoints" / f"step_{step}").glob("extra_rank*.pt")))

    def final_params(self, run_dir: Path) -> dict[str, torch.Tensor]:
        """The Hugging Face export written at the end of the run."""
        from safetensors.torch import load_file

        steps = self.checkpoint_steps(run_dir)
        assert steps and steps[-1] == self.max_steps, f"{run_dir}: complete checkpoints {steps}, want {self.max_steps}"
        files = sorted((run_dir / "hf").glob("*.safetensors"))
        assert files, f"{run_dir}/hf has no safetensors export"
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out

    @staticmethod
    def metric_steps(run_dir: Path) -> list[int]:
        path = run_dir / "metrics_train.csv"
        if not path.is_file():
            return []
        with open(path, newline="") as f:
            return [int(row["step"]) for row in csv.DictReader(f)]


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, exact: bool) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def free_job_id() -> str:
    """A job id whose rendezvous port (15000 + id % 15000, as train.sbatch derives it) is free now."""
    from slurm_cluster import job_id_with_free_rendezvous_ports

    return str(job_id_with_free_rendezvous_ports(count=1))


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
