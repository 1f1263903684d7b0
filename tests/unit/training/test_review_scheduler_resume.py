"""Review test: resuming the LR schedule keeps the position but follows the current config.

A run resumed with a longer `train.max_steps` must decay over the new total (hand-computed cosine),
not stay on the checkpoint's schedule; an unchanged config resumes exactly (same lr sequence as the
uninterrupted run).
"""
from __future__ import annotations

import math

import pytest
from torch import nn

from megatron_vlm.config.sections import OptimizerConfig, SchedulerConfig
from megatron_vlm.training.optim import build_optimizer, build_scheduler, load_scheduler_state


def _run(total: int, steps: int, state=None, lr: float = 1.0):
    m = nn.Linear(2, 2)
    opt = build_optimizer(m, OptimizerConfig(lr=lr), "cpu")
    sch = build_scheduler(opt, SchedulerConfig(type="cosine", warmup_steps=2), total)
    if state is not None:
        # what the optimizer checkpoint carries back: the lr of the saved run's next step
        for g, saved in zip(opt.param_groups, state["_last_lr"]):
            g["lr"] = saved
        load_scheduler_state(sch, state)
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    return used, sch.state_dict()


def _cosine(step: int, warmup: int, total: int, peak: float = 1.0) -> float:
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_unchanged_config_resumes_exactly():
    straight, _ = _run(10, 10)
    first, state = _run(10, 4)
    rest, _ = _run(10, 6, state)
    assert first + rest == pytest.approx(straight)


def test_longer_max_steps_on_resume_follows_the_new_schedule():
    _, state = _run(10, 6)
    used, _ = _run(20, 3, state)  # resumed with train.max_steps = 20: steps 6, 7, 8 of 20
    assert used == pytest.approx([_cosine(s, 2, 20) for s in (6, 7, 8)])


def test_new_peak_lr_on_resume_is_used():
    _, state = _run(10, 6)
    used, _ = _run(10, 1, state, lr=0.5)
    assert used == pytest.approx([_cosine(6, 2, 10, peak=0.5)])
