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
        # calls.txt: one line per call; argv.txt (python3): its arguments exactly, unit-separated
        exact = f"printf '%s\\037' \"$@\" >> \"{tmp_path}/argv.txt\"; echo >> \"{tmp_path}/argv.txt\"\n" \
            if name == "python3" else ""
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls.txt"\n{exact}')
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


def _lease_calls(tmp_path: Path) -> list[list[str]]:
    """The benchmark scripts (and their arguments) that every section of the lease script runs."""
    script, env = _copy(tmp_path)
    known = next(line for line in script.read_text().splitlines() if line.startswith("KNOWN="))
    sections = known.split("=", 1)[1].strip('"').split()  # every section the script knows
    r = subprocess.run(["bash", str(script), *sections], env={**env, "BUDGET_S": "100000"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [line.split("\x1f")[:-1] for line in (tmp_path / "argv.txt").read_text().splitlines()]
    # with arguments (gpu_env.py, the environment listing, takes none)
    return [c for c in calls if len(c) > 1 and c[0].startswith("benchmarks/") and c[0].endswith(".py")]


class _Parsed(Exception):
    pass


def test_every_lease_command_parses_with_its_scripts_own_parser(tmp_path, monkeypatch, capsys):
    """A misspelt option (or a variant name the script does not know) in a lease command exits 2 minutes into the
    lease and comes back without its row; here each command line goes through the script's own argparse parser
    (nothing is built or timed: the parse stops the script)."""
    import argparse
    import runpy
    import sys

    calls = _lease_calls(tmp_path)
    scripts = {c[0] for c in calls}
    assert {"benchmarks/e2e/bench_train_step.py", "benchmarks/e2e/profile_decode.py", "benchmarks/e2e/bench_fp8.py",
            "benchmarks/e2e/bench_rollout.py", "benchmarks/kernels/bench_attention.py"} <= scripts
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for script, *argv in calls:
        path = REPO / script
        with monkeypatch.context() as m:
            m.setattr(sys, "path", [str(path.parent), *sys.path])  # as `python benchmarks/.../<script>` has it
            m.setattr(sys, "argv", [str(path), *argv])
            try:
                runpy.run_path(str(path), run_name="__main__")
            except _Parsed:
                continue
            except SystemExit as e:
                raise AssertionError(f"{script} {' '.join(argv)}: exit {e.code}: {capsys.readouterr().err}") from None
            raise AssertionError(f"{script} {' '.join(argv)}: ran without parsing its command line")


def test_16k_step_takes_whole_block_checkpointing_on_an_80_gb_gpu(tmp_path):
    """Selective checkpointing at 16k tokens peaked at 90 GiB on an H200: a GPU reporting less than ~100 GB (an 80 GB
    H100) runs the 16k steps with whole-block checkpointing instead of an out-of-memory step; on the larger GPU the
    compiled whole-block step runs too (the form an 80 GB GPU would run), once."""
    script, env = _copy(tmp_path)
    for mib, want in (("81559", ["full"] * 5), ("143771", ["selective"] * 4 + ["full", "selective"])):
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.write_text(f'#!/bin/sh\ncase "$*" in *memory.total*noheader*) echo {mib};; esac\n')
        smi.chmod(0o755)
        (tmp_path / "argv.txt").unlink(missing_ok=True)
        r = subprocess.run(["bash", str(script), "sft16k"], env={**env, "BUDGET_S": "100000"}, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
        steps = [line.split("\x1f")[:-1] for line in (tmp_path / "argv.txt").read_text().splitlines()]
        acs = [c[c.index("--ac") + 1] for c in steps if "--ac" in c]
        assert acs == want, (mib, acs)
