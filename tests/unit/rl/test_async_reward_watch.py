"""Asynchronous GRPO: `rl.reward_pool.max_failed_steps` watches the rollout ranks' reward calls.

The rollout ranks score the completions; the training ranks' own reward manager only scores the held-out
evaluation. The watch must see one cumulative source, the rollout ranks' counters: a reward that starts failing
on every call mid-run (after successful steps) stops the run after `max_failed_steps` steps, as in the
synchronous loop."""
from __future__ import annotations

import types

import pytest

from megatron_vlm.rl.asynchronous import trainer as async_trainer
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch, RewardsAllFailedError
from megatron_vlm.training.loop import StopAfterStep
from megatron_vlm.training.running_totals import RunningTotals


class _GRPO:
    """`GRPOStep.train_on_rounds`' contract for the watch (rl/grpo_step.py): the step metrics carry this rank's
    reward manager's cumulative counters (here: the evaluation's 360 successful calls), then `extra_metrics`,
    and the watch is fed the result."""

    def __init__(self, max_failed_steps):
        self.reward_watch = RewardFailureWatch(max_failed_steps, key="rl.reward_pool.max_failed_steps")

    def train_on_rounds(self, step, rounds, timer, *, surplus=0, extra_metrics=None):  # noqa: ARG002
        out = {"reward/calls": 360.0, "reward/timeouts": 0.0, "reward/errors": 0.0, "reward/clipped": 0.0,
               "reward/worker_restarts": 0.0}
        out.update(extra_metrics or {})
        self.reward_watch.update(out, step + 1)
        return out


def _trainer(monkeypatch, max_failed_steps, counters):
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.k, t.bridge, t.model, t._trainable, t._last_end = 1, None, None, [], 0.0
    t.totals = RunningTotals()
    t.rl = types.SimpleNamespace(batch=types.SimpleNamespace(prompts_per_step=4))
    t.train_set = list(range(16))
    t.grpo = _GRPO(max_failed_steps)
    t._round = lambda step, payloads: None
    t._receive = lambda step: [{"step": step, "samples": [], "busy_s": 1.0, "idle_s": 0.0, "gen_s": 1.0, "reward_s": 0.1,
                                "skipped": 0, "reward_fail": counters(step)}]
    monkeypatch.setattr(async_trainer, "push_weights", lambda *a, **k: 0.0)
    return t


def _rollout_counters(fail_from):
    """The rollout rank's cumulative counters after step `step`: 32 calls a step, all failing from `fail_from` on."""
    def counters(step):
        calls = 32 * (step + 1)
        errors = 32 * max(0, step + 1 - fail_from)
        return {"reward/calls": float(calls), "reward/timeouts": 0.0, "reward/errors": float(errors),
                "reward/clipped": 0.0, "reward/worker_restarts": 0.0}
    return counters


@pytest.mark.parametrize("fail_from", [0, 5])
def test_rewards_that_fail_on_every_call_stop_the_async_run(monkeypatch, fail_from):
    """From the first step, or after five successful ones."""
    t = _trainer(monkeypatch, 3, _rollout_counters(fail_from=fail_from))
    for step in range(fail_from + 2):  # two failed steps in a row, not yet three
        t.train_step(step, log=True)
    # the step ran: the loop logs its row and saves what would be lost, then the run exits 1 with the error
    with pytest.raises(StopAfterStep, match=rf"^rl\.reward_pool\.max_failed_steps: .* 3 steps in a row, up to step "
                                            rf"{fail_from + 3}") as e:
        t.train_step(fail_from + 2, log=True)
    assert isinstance(e.value.error, RewardsAllFailedError) and e.value.wasted == 3
    assert "async/trainer_wait_s" in e.value.metrics  # the step's row, for the loop to log


def test_successful_rewards_never_stop_the_async_run(monkeypatch):
    t = _trainer(monkeypatch, 1, _rollout_counters(fail_from=10 ** 9))
    for step in range(6):
        m = t.train_step(step, log=True)
    assert m["reward/calls"] == 32 * 6 and m["reward/errors"] == 0
