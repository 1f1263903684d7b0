"""Asynchronous GRPO refuses a resume before any rollout rank loads weights.

A resume the loop refuses (a checkpoint past train.max_steps; a checkpoint of another prompt order) used to be found
by `run_loop` after the trainer had sent its start message and the full weight push: every rollout rank loaded the
model and the weights, then failed with exit 1. The trainer now checks first and sends the rollout ranks the refusal
instead of the start message; they exit 2 with the same one line. A valid resume still starts them at its step."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.rl.asynchronous import rollout_rank as rollout_mod
from megatron_vlm.rl.asynchronous import trainer as async_trainer
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.prompts.data_state import grpo_data_state

REPO = Path(__file__).resolve().parents[3]


class _Bridge:
    """Training rank 0's end: records what it broadcasts; a rollout rank's end: hands out `inbox`."""

    def __init__(self, inbox=()):
        self.sent, self.inbox = [], list(inbox)

    def broadcast_object(self, obj=None):
        if obj is not None:
            self.sent.append(obj)
            return obj
        return self.inbox.pop(0)


def _cfg():
    return load_config(REPO / "launch" / "configs" / "demo_grpo_async.toml")


def _trainer(monkeypatch, *, start_step, total_steps, resume_data=None):
    pushes = []
    monkeypatch.setattr(async_trainer, "push_weights", lambda model, bridge, version, *a, **k: pushes.append(version) or 0.0)
    bridge = _Bridge()
    cfg = _cfg()
    ctx = SimpleNamespace(cfg=cfg, env=SimpleNamespace(is_main=True), run_dir=None)
    role = SimpleNamespace(bridge=bridge, allocation=SimpleNamespace(rollout=1, train=1))
    make = lambda: AsyncGRPOLoopStep(ctx, list(range(40)), SimpleNamespace(), role, model=nn.Linear(2, 2),  # noqa: E731
                                     encoder=None, start_step=start_step, total_steps=total_steps,
                                     resume_data=resume_data)
    return make, bridge, pushes, cfg


def test_a_resume_past_the_end_is_refused_before_the_start_message_and_the_push(monkeypatch):
    make, bridge, pushes, _ = _trainer(monkeypatch, start_step=5, total_steps=3)
    with pytest.raises(ConfigError, match=r"^train\.max_steps: the checkpoint resumed is at step 5, past this run's 3"):
        make()
    assert pushes == []  # no weights sent
    assert [m["kind"] for m in bridge.sent] == ["refused"]
    assert bridge.sent[0]["error"].startswith("train.max_steps: the checkpoint resumed is at step 5")


def test_a_checkpoint_of_another_prompt_order_is_refused_first(monkeypatch):
    cfg = _cfg()
    state = grpo_data_state(2, seed=cfg.train.seed + 1, num_prompts=40, prompts_per_step=cfg.rl.batch.prompts_per_step)
    make, bridge, pushes, _ = _trainer(monkeypatch, start_step=2, total_steps=3, resume_data=state)
    with pytest.raises(ConfigError, match=r"^train\.seed"):
        make()
    assert pushes == [] and [m["kind"] for m in bridge.sent] == ["refused"]


def test_a_valid_resume_starts_the_rollout_ranks_at_its_step(monkeypatch):
    cfg = _cfg()
    state = grpo_data_state(2, seed=cfg.train.seed, num_prompts=40, prompts_per_step=cfg.rl.batch.prompts_per_step)
    make, bridge, pushes, _ = _trainer(monkeypatch, start_step=2, total_steps=3, resume_data=state)
    make()
    assert bridge.sent == [{"kind": "hello", "start_step": 2, "total_steps": 3, "num_prompts": 40}]
    assert pushes == [2]


def test_a_rollout_rank_exits_2_with_the_trainers_line_before_loading_anything(monkeypatch):
    line = "train.max_steps: the checkpoint resumed is at step 5, past this run's 3 steps"
    bridge = _Bridge([{"kind": "refused", "error": line}])

    def too_far(*a, **k):
        raise AssertionError("a refused rollout rank went on to load its processor")

    monkeypatch.setattr(rollout_mod, "load_processor", too_far)
    ctx = SimpleNamespace(cfg=_cfg(), env=SimpleNamespace(device="cpu"))
    with pytest.raises(ConfigError) as e:
        rollout_mod.run_rollout_rank(ctx, SimpleNamespace(bridge=bridge))
    assert str(e.value) == line
