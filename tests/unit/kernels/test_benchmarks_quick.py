"""Every kernel benchmark runs end to end with --quick on CPU (tiny shapes, torch timing): the
scripts stay runnable in CI; no timing is asserted (DESIGN.md §7). The five scripts start
together (each is mostly interpreter start-up and imports) to keep the file short."""
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels"
SCRIPTS = ["bench_attention.py", "bench_rms_norm.py", "bench_rotary.py", "bench_swiglu.py", "bench_linear_token_logprobs.py"]


def test_benchmarks_run_quick():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    procs = {
        script: subprocess.Popen(
            [sys.executable, str(BENCH_DIR / script), "--quick"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=BENCH_DIR,
        )
        for script in SCRIPTS
    }
    problems = []
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            problems.append(f"{script}: exit {proc.returncode}\n{out[-1500:]}\n{err[-3000:]}")
        elif "peaks measured now" not in out or "vs base" not in out:
            problems.append(f"{script}: no result table\n{out[-1500:]}")
        else:
            failed = [line for line in out.splitlines() if " n/a " in line]
            if failed:
                problems.append(f"{script}: rows failed\n" + "\n".join(failed))
    assert not problems, "\n\n".join(problems)
