"""A worker of the length pass (`data.num_workers`) that dies mid-task stops the pass with an error naming the
key, within seconds: the kernel's OOM killer (SIGKILL) or a stop signal sent to the whole process group (TERM)
left the rank waiting forever for the dead worker's chunk (`multiprocessing.Pool.map` never returns then), and
the other ranks in the all-gather until the process-group timeout. SIGUSR1, a stop request SLURM sends to every
process of a job step, is the rank's to handle: a worker ignores it and the pass finishes.

Each pass runs in a child interpreter with a time limit, so a hang fails the test instead of blocking it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_PASS = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import megatron_vlm.data.lengths as lengths

    SIGNAL = os.environ["LENGTHS_TEST_SIGNAL"]


    def estimate(source, proc, indices, **options):  # stands in for the real pass: the second chunk's worker dies
        if indices[0] == lengths._POOL_CHUNK:
            os.kill(os.getpid(), getattr(signal, SIGNAL))
            time.sleep(0.5)
        return np.full((len(indices), 2), 7, dtype=np.int64), []


    # at import: the worker server imports this file (its __main__) and forks the pass's workers from it
    lengths._estimate = estimate

    if __name__ == "__main__":
        try:
            got, bad = lengths._pooled_slice(None, None, list(range(4 * lengths._POOL_CHUNK)), 2, {})
        except lengths.LengthEstimateError as e:
            print("error:", e)
        else:
            print("done:", len(got), int(got[:, 0].sum()))
""")


def _run_pass(signame: str, tmp_path: Path) -> str:
    script = tmp_path / "length_pass.py"  # a file, not -c: the worker server imports the entry point by its path
    script.write_text(_PASS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO), "LENGTHS_TEST_SIGNAL": signame}, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM"])
def test_a_worker_killed_mid_task_is_an_error_not_a_hang(signame, tmp_path):
    out = _run_pass(signame, tmp_path)
    assert out.startswith("error: planning lengths: a worker process of the pass (data.num_workers = 2) ended "
                          "abruptly"), out
    assert "data.num_workers = 0" in out


def test_a_worker_ignores_the_usr1_stop_request_and_the_pass_finishes(tmp_path):
    assert _run_pass("SIGUSR1", tmp_path) == f"done: {4 * 256} {7 * 4 * 256}"
