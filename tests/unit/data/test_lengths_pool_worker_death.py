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

    def estimate(source, proc, indices, **options):  # stands in for the real pass: the second chunk's worker dies
        if indices[0] == lengths._POOL_CHUNK:
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            time.sleep(0.5)
        return np.full(len(indices), 7, dtype=np.int64), []

    lengths._estimate = estimate
    try:
        got, bad = lengths._pooled_slice(None, None, list(range(4 * lengths._POOL_CHUNK)), 2, {})
    except lengths.LengthEstimateError as e:
        print("error:", e)
    else:
        print("done:", len(got), int(got.sum()))
""")


def _run_pass(signame: str) -> str:
    r = subprocess.run([sys.executable, "-c", _PASS, signame], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM"])
def test_a_worker_killed_mid_task_is_an_error_not_a_hang(signame):
    out = _run_pass(signame)
    assert out.startswith("error: planning lengths: a worker process of the pass (data.num_workers = 2) ended "
                          "abruptly"), out
    assert "data.num_workers = 0" in out



def test_a_worker_ignores_the_usr1_stop_request_and_the_pass_finishes():
    assert _run_pass("SIGUSR1") == f"done: {4 * 256} {7 * 4 * 256}"
