"""A stop signal that reaches only a training rank other than 0 of asynchronous GRPO (`kill -TERM` of one rank, a
node of a multi-node trainer preempted) while training rank 0 waits for the rollout ranks' groups.

That rank sat in the all-gather of the step's payloads, which rank 0 joins only once the payloads are in: its signal
was seen neither by rank 0 (which waited on a hung rollout rank for as long as it hung) nor by itself (its handler
runs when the collective returns), so the job went on to the scheduler's SIGKILL and lost its checkpoint. Now the
training ranks meet every poll of the wait in a small all-reduce that carries their stop signals: rank 0 sees the
signal within a poll, stops the rollout ranks after the grace, and every rank abandons the step, saves and exits
143 within seconds."""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.abandon import ABANDON_GRACE_S
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.training.loop import EXIT_STOPPED, run_loop
from megatron_vlm.training.signals import StopFlag

HUNG_S = 40.0
"""How long the hung rollout rank keeps the trainer waiting when nobody stops it (past the test's bound)."""


class _HungRollout:
    """Training rank 0's end of the bridge to one rollout rank whose scoring hangs: it answers a step's "want" only
    with the "stopped" payload that "stop" asks for (or after HUNG_S)."""

    def __init__(self):
        self.sent: list[dict] = []

    def broadcast_object(self, msg):
        self.sent.append(msg)

    def recv_object(self, src):  # noqa: ARG002
        end = time.monotonic() + HUNG_S
        while time.monotonic() < end and not any(m.get("kind") == "stop" for m in self.sent):
            time.sleep(0.02)
        step = [m for m in self.sent if m.get("kind") == "want"][-1]["step"]
        return {"step": step, "stopped": True, "signum": 0}


class _Step(AsyncGRPOLoopStep):
    """The trainer's step with the rollout exchange only: step 0 trains without it (so that the stop has a step to
    save), later steps wait for their groups."""

    def train_step(self, step, *, log):  # noqa: ARG002
        if step > 0:
            self._receive(step)
        return {"loss": 1.0}

    def data_state(self, step):
        return {"next_step": step}

    def evaluate(self, step):  # noqa: ARG002
        return None

    def finish(self):
        self._stop_rollout()


class _Checkpointer:
    enabled, export_at_end = True, False

    def __init__(self):
        self.saved: list[int] = []

    def periodic_due(self, step):  # noqa: ARG002
        return False

    def save(self, step, data_state):  # noqa: ARG002
        self.saved.append(step)


def _trainer_rank(rank: int, init_file: str, out: str) -> None:
    stop = StopFlag().install()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    cpu = torch.device("cpu")
    t = _Step.__new__(_Step)
    t.ctx = NS(stop=stop, env=NS(device=cpu), device=cpu, run_dir=None)
    t.bridge = _HungRollout() if rank == 0 else None
    t.role = NS(allocation=NS(rollout=1, train=2))
    t.total_steps, t._prefetch, t.bad_records, t._stopped = 4, None, BadRecordLog(), False
    ckpt = _Checkpointer()

    def before_step(n: int) -> None:
        if n == 2:  # step 1 (0-based) is about to wait for its groups
            Path(f"{out}.waiting.{rank}").touch()

    code = run_loop(t.ctx, t, total_steps=4, checkpointer=ckpt, metrics=NS(set_start=lambda s: None,
                                                                           log=lambda *a: None),
                    log_every=1, before_step=before_step)
    Path(f"{out}.{rank}").write_text(json.dumps({"code": code, "saved": ckpt.saved, "signum": stop.signum,
                                                 "stopped_rollout": [m for m in getattr(t.bridge, "sent", [])
                                                                     if m.get("kind") == "stop"]}))
    dist.destroy_process_group()


def test_a_stop_signal_on_training_rank_1_alone_stops_the_job_waiting_on_rank_0(tmp_path):
    out = str(tmp_path / "res")
    fork = mp.get_context("fork")  # the ranks start in a moment (no imports); they use no device
    procs = [fork.Process(target=_trainer_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{out}.waiting.{r}") for r in range(2)):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "the ranks did not reach step 1"
            time.sleep(0.05)
        time.sleep(0.3)  # both wait: rank 0 on the rollout rank, rank 1 on rank 0
        os.kill(procs[1].pid, signal.SIGTERM)
        t0 = time.monotonic()
        bound = ABANDON_GRACE_S + 5.0
        for p in procs:
            p.join(timeout=max(0.1, t0 + bound - time.monotonic()))
        took = time.monotonic() - t0
        assert not any(p.is_alive() for p in procs), f"the job still ran {took:.1f} s after the signal"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r["code"] for r in results] == [EXIT_STOPPED] * 2, results
    assert [r["saved"] for r in results] == [[1], [1]], results  # the step before the abandoned one
    assert [r["signum"] for r in results] == [int(signal.SIGTERM)] * 2, results
    assert results[0]["stopped_rollout"] == [{"kind": "stop", "signum": int(signal.SIGTERM)}], results
