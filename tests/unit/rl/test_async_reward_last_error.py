"""Asynchronous GRPO: the line that stops a run whose rewards all fail names the verifier's last error.

The rollout ranks make the reward calls; the trainer's own reward manager only scores the held-out evaluation, so
its `last_error` is empty. The stop line (rl/rewards/failure_watch.py: "...; last error: <what failed>") must carry
the rollout ranks' last error, as the synchronous loop's carries its ranks'."""
from __future__ import annotations

import types

import pytest

from megatron_vlm.rl.asynchronous import trainer as async_trainer
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch, RewardsAllFailedError
from megatron_vlm.training.loop import StopAfterStep
from megatron_vlm.training.running_totals import RunningTotals


class _GRPO:
    """`GRPOStep.train_on_rounds`' contract for the watch (rl/grpo_step.py): fed the step's counters and its reward
    manager's `last_error`."""

    def __init__(self):
        self.reward_watch = RewardFailureWatch(2, key="rl.reward_pool.max_failed_steps")
        self.manager = types.SimpleNamespace(last_error="")  # the evaluation's manager: no failed call

    def train_on_rounds(self, step, rounds, timer, *, surplus=0, extra_metrics=None):  # noqa: ARG002
        out = dict(extra_metrics or {})
        self.reward_watch.update(out, step + 1, getattr(self.manager, "last_error", ""))
        return out


def bare_async_step(grpo) -> AsyncGRPOLoopStep:
    """An AsyncGRPOLoopStep without a bridge or model (k = 1, 4 prompts a step of 16), `grpo` its GRPOStep stand-in,
    rounds ignored: what its `train_step` bookkeeping needs."""
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.k, t.bridge, t.model, t._trainable, t._last_end = 1, None, None, [], 0.0
    t.totals = RunningTotals()
    t.rl = types.SimpleNamespace(batch=types.SimpleNamespace(prompts_per_step=4))
    t.train_set = list(range(16))
    t.grpo = grpo
    t._round = lambda step, payloads: None
    return t


def test_the_stop_line_names_the_rollout_ranks_last_reward_error(monkeypatch):
    t = bare_async_step(_GRPO())
    error = "reward 'accuracy': error: ZeroDivisionError: division by zero"

    def receive(step):
        n = 32.0 * (step + 1)
        return [{"step": step, "samples": [], "busy_s": 1.0, "idle_s": 0.0, "gen_s": 1.0, "reward_s": 0.1, "skipped": 0,
                 "reward_last_error": error,
                 "reward_fail": {"reward/calls": n, "reward/timeouts": 0.0, "reward/errors": n, "reward/clipped": 0.0,
                                 "reward/worker_restarts": 0.0}}]

    t._receive = receive
    monkeypatch.setattr(async_trainer, "push_weights", lambda *a, **k: 0.0)
    t.train_step(0, log=True)
    with pytest.raises(StopAfterStep, match="last error: reward 'accuracy': error: ZeroDivisionError") as e:
        t.train_step(1, log=True)
    assert isinstance(e.value.error, RewardsAllFailedError)
