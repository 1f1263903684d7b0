"""Asynchronous GRPO's step times and throughput (rl/asynchronous/trainer.py) mean what the synchronous loop's do:
`time/step_s` is the trainer's whole step (waiting for the rollout ranks' samples, the update, the weight push),
and `perf/rollout_tokens_per_s` the rollout ranks' generated tokens per second of generation; `rollout/preemptions`
sums the rollout ranks' preemptions (the on-demand paged pool)."""
from __future__ import annotations

import time
import types

import pytest
import torch

from megatron_vlm.rl.asynchronous import trainer as async_trainer
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.training.running_totals import RunningTotals

WAIT_S, TRAIN_S, PUSH_S = 0.15, 0.05, 0.05


class _GRPO:
    """`GRPOStep.train_on_rounds`' timing contract: the update's phases in `timer`, its metrics from `timer.metrics`."""

    def train_on_rounds(self, step, rounds, timer: PhaseTimer, *, surplus=0, extra_metrics=None):  # noqa: ARG002
        with timer.phase("train"):
            time.sleep(TRAIN_S)
        out = timer.metrics({"train": 100.0})
        out.update(extra_metrics or {})
        return out


def _payload(step: int, tokens: int, gen_s: float) -> dict:
    sample = {"token_versions": torch.full((tokens,), step), "token_ids": torch.zeros(tokens, dtype=torch.long)}
    return {"step": step, "samples": [sample], "busy_s": gen_s, "idle_s": 0.0, "gen_s": gen_s, "reward_s": 0.01,
            "skipped": 0, "reward_fail": {}, "preemptions": float(tokens // 100)}


def _trainer(monkeypatch) -> AsyncGRPOLoopStep:
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.k, t.bridge, t.model, t._trainable = 1, None, None, []
    t.totals = RunningTotals()
    t.rl = types.SimpleNamespace(batch=types.SimpleNamespace(prompts_per_step=4))
    t.train_set = list(range(16))
    t.grpo = _GRPO()
    t._round = lambda step, payloads: None

    def receive(step):  # the samples arrive after WAIT_S: two rollout ranks, 300 tokens in 2 s and 100 in 0.5 s
        time.sleep(WAIT_S)
        return [_payload(step, 300, 2.0), _payload(step, 100, 0.5)]

    def push(*a, **k):
        time.sleep(PUSH_S)
        return PUSH_S

    t._receive = receive
    monkeypatch.setattr(async_trainer, "push_weights", push)
    t._last_end = time.perf_counter()
    return t


def test_async_step_time_is_the_trainers_whole_step(monkeypatch):
    """Before: time/step_s was the sum of the update's phases alone (0.05 s here), smaller than the time/rollout_s
    logged beside it and blind to the wait for samples that async/trainer_idle_frac reports."""
    t = _trainer(monkeypatch)
    for step in range(2):
        m = t.train_step(step, log=True)
        assert m["time/step_s"] >= WAIT_S + TRAIN_S + PUSH_S
        assert m["async/trainer_idle_frac"] == pytest.approx(m["async/trainer_wait_s"] / m["time/step_s"], rel=1e-6)


def test_async_rollout_throughput_is_reported(monkeypatch):
    """Before: perf/rollout_tokens_per_s (a documented GRPO metric) was missing from asynchronous runs."""
    m = _trainer(monkeypatch).train_step(0, log=True)
    assert m["perf/rollout_tokens_per_s"] == pytest.approx(300 / 2.0 + 100 / 0.5)
    assert m["perf/train_tokens_per_s"] == pytest.approx(100.0 / TRAIN_S, rel=0.5)


def test_async_rollout_preemptions_are_summed_over_the_rollout_ranks(monkeypatch):
    """The rollout ranks' engines preempt on their on-demand paged pools; the step's rollout/preemptions is their sum
    (before: never reported by asynchronous runs)."""
    m = _trainer(monkeypatch).train_step(0, log=True)
    assert m["rollout/preemptions"] == 3.0 + 1.0


def test_async_policy_version_is_the_generating_policys(monkeypatch):
    """rollout/policy_version is the mean version of the step's generated tokens (before: the trainer's step, which
    the samples of an asynchronous run are older than)."""
    t = _trainer(monkeypatch)
    old = t._receive

    def receive(step):  # rank 0's 300 tokens from the previous version, rank 1's 100 from this one
        p0, p1 = old(step)
        p0["samples"][0]["token_versions"] = torch.full((300,), step - 1)
        return [p0, p1]

    t._receive = receive
    m = t.train_step(3, log=True)
    assert m["rollout/policy_version"] == pytest.approx(3 - 300 / 400)
