"""A SIGTERM that reaches only a rollout rank (its node preempted in a multi-node job) must stop the whole job at the
next step boundary with a checkpoint, as a SIGTERM on any rank of the synchronous loop does.

The training loop's stop check (`StopFlag.should_stop`) reduces over the training ranks only: a rollout rank's flag
never reached it, the trainer kept training until that rank was killed, and the job ended with the work since the
last periodic checkpoint lost. The rollout rank now reports its signal with every step it sends; the trainer raises its
own flag from it."""
from __future__ import annotations

import queue
import threading
import time
import types

import torch

from megatron_vlm.rl.asynchronous import rollout_rank as rr
from megatron_vlm.rl.asynchronous import trainer as async_trainer
from megatron_vlm.training.signals import StopFlag
from tests.unit.rl.test_async_reward_last_error import bare_async_step


class _GRPO:
    def train_on_rounds(self, step, rounds, timer, *, surplus=0, extra_metrics=None):  # noqa: ARG002
        return dict(extra_metrics or {})


def _payload(step, signum=0):
    return {"step": step, "samples": [], "busy_s": 1.0, "idle_s": 0.0, "gen_s": 1.0, "reward_s": 0.1, "skipped": 0,
            "reward_fail": {}, "signum": signum}


def test_the_trainer_stops_on_a_rollout_ranks_sigterm(monkeypatch):
    t = bare_async_step(_GRPO())
    t.ctx = types.SimpleNamespace(stop=StopFlag())
    monkeypatch.setattr(async_trainer, "push_weights", lambda *a, **k: 0.0)
    t._receive = lambda step: [_payload(step), _payload(step)]
    t.train_step(0, log=True)
    assert t.ctx.stop.signum == 0
    t._receive = lambda step: [_payload(step), _payload(step, signum=15)]
    t.train_step(1, log=True)
    assert t.ctx.stop.signum == 15
    assert t.ctx.stop.should_stop(torch.device("cpu"))


class _Bridge:
    """The trainer asks for step 0, then (once step 0 arrived) stops the rank."""

    def __init__(self):
        self.messages = [{"kind": "want", "step": 0}, {"kind": "stop"}]
        self.sent = []

    def broadcast_object(self, obj=None):
        while len(self.messages) == 1 and not self.sent:
            time.sleep(0.01)
        return self.messages.pop(0)

    def send_object(self, obj, dst=0):
        self.sent.append(obj)


def test_a_rollout_rank_reports_its_sigterm_with_its_samples():
    state = rr._State(0)
    state.engine = types.SimpleNamespace(interrupt=lambda: None)
    state.signum = lambda: 15  # the rank's StopFlag after a SIGTERM
    bridge = _Bridge()
    todo: queue.Queue = queue.Queue()
    todo.put({"step": 0, "indices": [], "result": None, "idle_s": 0.0, "busy_s": 0.0, "skipped": 0, "bad_records": []})
    todo.put(None)
    manager = types.SimpleNamespace(metrics=lambda: {}, last_error="")
    w = threading.Thread(target=rr._weights_loop, args=(state, bridge, None, state.engine), daemon=True)
    w.start()
    rr._score_loop(state, bridge, todo, manager, [])
    w.join(timeout=5)
    assert state.error is None, state.error
    assert [p["step"] for p in bridge.sent] == [0] and bridge.sent[0].get("signum") == 15


class _StoppingTrainer:
    """The trainer's side of a job stopped by a SIGTERM that reached the trainer only: hello, first push, "stop"."""

    def __init__(self):
        self.messages = [{"kind": "hello", "start_step": 0, "total_steps": 1000, "num_prompts": 4},
                         {"kind": "weights", "version": 0, "names": []}, {"kind": "stop", "signum": 15}]

    def broadcast_object(self, obj=None):
        return self.messages.pop(0)

    def send_object(self, obj, dst=0):
        raise AssertionError("nothing was asked for")


def test_every_rollout_rank_exits_143_after_a_sigterm_stop(monkeypatch, tmp_path):
    """The trainer's stop after a SIGTERM (its own, or another rank's) makes every rollout rank exit 143, also one
    that received no signal itself (another node): the job reads as stopped to be resumed, not as finished."""
    from megatron_vlm.rl.asynchronous.allocation import Allocation
    from megatron_vlm.rl.asynchronous.bridge import Role
    from tests.unit.rl.test_async_rollout_failure import rollout_rank_context

    ctx = rollout_rank_context(monkeypatch, tmp_path)
    role = Role(name="rollout", rank=0, allocation=Allocation(rollout=1, train=1), global_rank=1,
                bridge=_StoppingTrainer())
    assert ctx.stop.signum == 0
    assert rr.run_rollout_rank(ctx, role) == rr.EXIT_STOPPED
