"""A warmup at or past the run's last optimizer step never lets the lr reach (or leave) its peak:
one warning naming the scheduler key, none for a warmup shorter than the run."""
from __future__ import annotations

import logging

from torch import nn

from megatron_vlm.config.sections import OptimizerConfig, SchedulerConfig
from megatron_vlm.training.optim import build_optimizer, build_scheduler


def _warnings(caplog, sched: SchedulerConfig, total: int) -> list[str]:
    opt = build_optimizer(nn.Linear(2, 2), OptimizerConfig(lr=2e-3), "cpu")
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        caplog.clear()
        build_scheduler(opt, sched, total)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_warmup_steps_past_the_run_warns_once(caplog):
    msgs = _warnings(caplog, SchedulerConfig(warmup_steps=20), 2)  # the staged run: lr 1e-4, 2e-4 of 2e-3
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("scheduler.warmup_steps:") and "20" in msgs[0] and "2 optimizer steps" in msgs[0]
    assert "0.1" in msgs[0]  # the highest lr reached: 2/20 of the peak


def test_warmup_ratio_resolving_to_the_whole_run_warns(caplog):
    msgs = _warnings(caplog, SchedulerConfig(warmup_ratio=0.9), 1)  # round(0.9 x 1) = 1 warmup step of 1
    assert len(msgs) == 1 and msgs[0].startswith("scheduler.warmup_ratio:"), msgs


def test_short_warmup_is_silent(caplog):
    assert _warnings(caplog, SchedulerConfig(warmup_steps=5), 60) == []
    assert _warnings(caplog, SchedulerConfig(warmup_ratio=0.03), 600) == []
    assert _warnings(caplog, SchedulerConfig(), 2) == []
