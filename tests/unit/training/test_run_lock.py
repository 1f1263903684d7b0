"""One writer per run folder: a second job on a `train.output_dir` that a running job holds exits 2 with one
line naming the key, before it touches the folder (the first job's in-flight `.tmp_step_*` survives); a
folder that is a file or cannot be written is refused the same way; the lock dies with its process."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_vlm.errors import ConfigError
from megatron_vlm.training import run_lock
from megatron_vlm.training.run_lock import claim_run_dir

REPO = Path(__file__).resolve().parents[3]


def test_second_claim_is_refused_until_the_first_is_released(tmp_path):
    run = tmp_path / "run"
    first = claim_run_dir(run)
    with pytest.raises(ConfigError, match=rf"train.output_dir: {run} is in use by another job \(pid {os.getpid()} on "):
        claim_run_dir(run)
    first.release()
    claim_run_dir(run).release()


def test_a_file_or_an_unwritable_folder_is_refused_naming_the_key(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="train.output_dir: .* is a file"):
        claim_run_dir(f)
    with pytest.raises(ConfigError, match="train.output_dir: cannot use"):
        claim_run_dir(f / "below")

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(run_lock.os, "open", read_only)
    with pytest.raises(ConfigError, match="train.output_dir: cannot use .*Read-only file system"):
        claim_run_dir(tmp_path / "ro")


def test_a_second_job_on_a_held_run_folder_exits_2_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron_vlm.training.run_lock import claim_run_dir; "
         f"claim_run_dir({str(run)!r}); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        inflight = run / "checkpoints" / ".tmp_step_2"
        inflight.mkdir(parents=True)
        r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config",
                            str(REPO / "launch" / "configs" / "demo_sft.toml"), "--set", f'train.output_dir="{run}"'],
                           capture_output=True, text=True, timeout=300, cwd=str(REPO))
        assert r.returncode == 2, r.stderr[-3000:]
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines[-1].startswith("config error: train.output_dir:") and "in use by another job" in lines[-1]
        assert "Traceback" not in r.stderr
        assert inflight.is_dir() and not (run / "config.toml").exists()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    claim_run_dir(run).release()  # killed holder: no stale lock


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="megatron_vlm"):
        claim_run_dir(tmp_path / "run").release()
    assert "not protected against a second job" in caplog.text


def test_a_process_the_job_forked_does_not_keep_the_folder_locked(tmp_path):
    """Forked helpers (DataLoader and length-pass workers) got a copy of the lock's descriptor: one that outlived its
    job (the rank killed by the OOM killer, a worker stuck in a decode) kept the folder locked, and the requeued job
    was refused as "in use by another job (pid <the dead rank>)"."""
    run = tmp_path / "run"
    code = (f"import os, time\nfrom megatron_vlm.training.run_lock import claim_run_dir\nclaim_run_dir({str(run)!r})\n"
            "pid = os.fork()\nif pid == 0:\n    null = os.open(os.devnull, os.O_RDWR)\n"
            "    for f in (0, 1, 2):\n        os.dup2(null, f)\n    time.sleep(60)\n    os._exit(0)\n"
            "print(pid, flush=True)\nos._exit(0)\n")  # the job ends at once; its forked helper lives on
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    helper = int(r.stdout.split()[0])
    try:
        claim_run_dir(run).release()
    finally:
        os.kill(helper, 9)
