"""Checkpoint faults across two gloo processes, and through a whole SFT job.

- Disk full on one rank while saving: every rank raises the same clear `CheckpointError` within
  seconds (no rank left in a barrier until the process-group timeout), for a failure on rank 1
  while writing its files and on rank 0 while committing; the previous checkpoint is intact and
  loads on both ranks, and no temporary folder is left.
- A job whose newest checkpoint is corrupt resumes from the previous complete one (and says so).

This file is also the two-process driver: `torchrun ... test_checkpoint_faults.py <out_dir>`.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent


def _driver(out_dir: Path) -> None:
    """Runs on each rank: save step 2, then two saves that fail with ENOSPC, then load step 2."""
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_vlm.checkpoint import manager as manager_mod
    from megatron_vlm.checkpoint.manager import CheckpointManager

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    mgr = CheckpointManager(out_dir, keep_last=0, rank=rank)
    with torch.no_grad():
        model.weight.fill_(2.0)
    mgr.save(2, model, opt, {"tag": 2})
    with torch.no_grad():
        model.weight.fill_(4.0)

    def attempt(step: int) -> dict:
        t0 = time.monotonic()
        try:
            mgr.save(step, model, opt, {"tag": step})
            err = None
        except BaseException as e:  # noqa: BLE001 - the test checks which error, on every rank
            err = f"{type(e).__name__}: {e}"
        return {"error": err, "seconds": time.monotonic() - t0}

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_save, real_replace = torch.save, os.replace
    results = {}
    # 1. rank 1 cannot write its extra file (its DCP shard got written)
    if rank == 1:
        manager_mod.torch.save = lambda obj, f, *a, **k: (
            enospc() if "extra_rank" in str(getattr(f, "name", f)) else real_save(obj, f, *a, **k))
    results["write"] = attempt(4)
    torch.save = real_save
    # 2. rank 0 cannot put the finished folder in place
    if rank == 0:
        os.replace = lambda src, dst: enospc() if ".tmp_step_" in str(src) else real_replace(src, dst)
    results["commit"] = attempt(6)
    os.replace = real_replace
    # the previous checkpoint loads on every rank
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    extra = CheckpointManager(out_dir, keep_last=0, rank=rank).load(out_dir / "checkpoints" / "step_2", fresh, fresh_opt)
    results["loaded_tag"] = extra["tag"]
    results["loaded_weight"] = float(fresh.weight.mean())
    (out_dir / f"result_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def test_disk_full_on_one_rank_fails_every_rank_quickly_and_keeps_the_previous(tmp_path):
    from jobs import REPO, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__)), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-6000:]
    res = [json.loads((tmp_path / f"result_rank{i}.json").read_text()) for i in range(2)]
    for rank, got in enumerate(res):
        w, c = got["write"], got["commit"]
        assert w["error"] and w["error"].startswith("CheckpointError: saving checkpoint step_4 failed while writing shards on rank 1:"), (rank, w)
        assert c["error"] and c["error"].startswith("CheckpointError: saving checkpoint step_6 failed while committing on rank 0:"), (rank, c)
        for e in (w, c):
            assert "disk full" in e["error"] and "step_2 is intact" in e["error"], e
            assert e["seconds"] < 30, e  # agreed at once, not after a collective timeout
        assert got["loaded_tag"] == 2 and got["loaded_weight"] == 2.0
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_2"]
    assert (ck / "step_2" / "COMPLETE").is_file()


@pytest.mark.slow
def test_job_resumes_from_the_previous_checkpoint_when_the_newest_is_corrupt(tmp_path):
    from jobs import run_job_here, small_demo_overrides

    assets = tmp_path / "assets"
    out = tmp_path / "run"
    common = {"checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.export_hf": "false",
              "train.eval_every": 0}
    run_job_here(small_demo_overrides(out, assets, **{"train.max_steps": 4, **common}))
    step4 = out / "checkpoints" / "step_4"
    for f in step4.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:16])  # truncated shard, marker still there
    r = run_job_here(small_demo_overrides(out, assets, **{"train.max_steps": 6, **common}))
    assert f"cannot load checkpoint {step4}" in r.stderr and "falling back" in r.stderr
    assert "Resumed from checkpoint: step=2" in r.stderr
    assert (out / "checkpoints" / "step_6" / "COMPLETE").is_file()
    assert (out / "checkpoints" / "step_4" / "COMPLETE").is_file()  # written again, whole


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    _driver(Path(sys.argv[1]))


def test_a_crash_with_data_loader_workers_ends_the_process(tmp_path):
    """An unexpected exception (a bug, a peer rank's dropped connection, a loader worker killed by the OOM killer)
    left the process hanging forever instead of exiting 1 when the loader had workers (`data.num_workers`, 1 in the
    demo): the uncaught exception's traceback kept the loader's iterator alive, and at exit multiprocessing ended
    its workers with SIGTERM, which they ignore (they leave stop signals to their rank), then joined them without
    a timeout. SIGTERM to the rank only set its stop flag, so only SIGKILL ended it."""
    import subprocess

    from jobs import run_job, small_demo_overrides

    out = tmp_path / "run"
    try:
        r = run_job(small_demo_overrides(out, tmp_path / "assets", **{"data.num_workers": 1, "checkpoint.export_hf": "false"}),
                    env={"MEGATRON_VLM_FAULT_RAISE_AT_STEP": "3"}, check=False, timeout=300)  # the hang was forever
    except subprocess.TimeoutExpired:
        raise AssertionError("the crashed job did not end") from None
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "RuntimeError: fault injected before step 3" in r.stderr
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
