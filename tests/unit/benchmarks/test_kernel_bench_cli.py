"""Every kernel benchmark takes `--quick`: launch/slurm/bench_kernels.sbatch passes its arguments to each
benchmarks/kernels/bench_*.py, and `sbatch launch/slurm/bench_kernels.sbatch --quick` (the smoke test of them
all) must not fail a job because one script refuses the option.

Each script's own argument parser reads the command line and the run stops there (nothing is timed)."""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels"


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("script", sorted(p.name for p in KERNELS.glob("bench_*.py")))
def test_kernel_benchmark_accepts_quick(script, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(KERNELS / script), "--quick"])
    monkeypatch.setattr(sys, "path", [str(KERNELS), *sys.path])  # as `python benchmarks/kernels/<script>` has it
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(KERNELS / script), run_name="__main__")
    assert parsed.value.args[0].quick is True
