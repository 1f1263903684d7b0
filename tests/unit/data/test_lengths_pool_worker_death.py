"""A worker of the length pass (`data.num_workers`) that dies mid-task stops the pass with an error naming the
key, within seconds: the kernel's OOM killer (SIGKILL) or a stop signal sent to the whole process group (TERM)
left the rank waiting forever for the dead worker's chunk (`multiprocessing.Pool.map` never returns then), and
the other ranks in the all-gather until the process-group timeout. SIGUSR1, a stop request SLURM sends to every
process of a job step, is the rank's to handle: a worker ignores it and the pass finishes. The workers come from the
worker server, not the rank, so a rank killed mid-pass must end them itself (a watch on its pid).

Each pass runs in a child interpreter with a time limit, so a hang fails the test instead of blocking it; the
interpreter runs a script file, which the worker server imports, so the stand-in estimate reaches the workers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_PASS = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import megatron_vlm.data.lengths as lengths

    SIGNAL = os.environ["LENGTHS_TEST_SIGNAL"]


    def estimate(source, proc, indices, **options):  # stands in for the real pass: the second chunk's worker dies
        if indices[0] == lengths._POOL_CHUNK and SIGNAL == "RANK_KILLED":  # the worker outlives its chunk; the rank dies
            with open(os.environ["LENGTHS_TEST_PIDFILE"] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.environ["LENGTHS_TEST_PIDFILE"] + ".tmp", os.environ["LENGTHS_TEST_PIDFILE"])
            time.sleep(600)
        elif indices[0] == lengths._POOL_CHUNK:
            os.kill(os.getpid(), getattr(signal, SIGNAL))
            time.sleep(0.5)
        return np.full((len(indices), 2), 7, dtype=np.int64), []


    # at import: the worker server imports this file (its __main__) and forks the pass's workers from it
    lengths._estimate = estimate

    def kill_the_rank_once_a_worker_runs():
        while not os.path.exists(os.environ["LENGTHS_TEST_PIDFILE"]):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


    if __name__ == "__main__":
        if SIGNAL == "RANK_KILLED":
            import threading
            threading.Thread(target=kill_the_rank_once_a_worker_runs, daemon=True).start()
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_ends_when_its_rank_is_killed(tmp_path):
    """The pass's workers are the worker server's children, not the rank's: a rank killed mid-pass (OOM killer,
    kill -9) must not leave a worker running its chunk (memory held, the job's output pipes kept open)."""
    script, pidfile = tmp_path / "length_pass.py", tmp_path / "worker.pid"
    script.write_text(_PASS)
    with open(tmp_path / "stderr.txt", "w") as err:  # a file, not a pipe: a surviving worker would hold a pipe open
        rc = subprocess.run([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=err, timeout=60,
                            cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO), "LENGTHS_TEST_SIGNAL": "RANK_KILLED",
                                                "LENGTHS_TEST_PIDFILE": str(pidfile)}).returncode
    assert rc == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-3000:]
    worker = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the killed rank's length-pass worker still runs"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
