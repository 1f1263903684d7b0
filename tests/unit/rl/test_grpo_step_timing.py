"""A synchronous GRPO step's `time/step_s` includes the rollout engine's weight refresh (`time/weight_sync_s`):
with rl.rollout.weights = "copy" / "expert_parallel" the refresh gathers the trainer's weights every step, time the
step took that its phases' sum left out before."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from megatron_vlm.rl.grpo_step import GRPOStep

SYNC_S = 0.05


class _Engine:
    def load_weights(self, weights=None, *, version):  # noqa: ARG002
        time.sleep(SYNC_S)


def test_step_time_includes_the_weight_refresh():
    step = GRPOStep.__new__(GRPOStep)
    step.engine = _Engine()
    step.rounds = SimpleNamespace(sample=lambda s, batch, pool, timer: ([], 0))
    step.train_on_rounds = lambda s, rounds, timer, surplus=0: timer.metrics()
    m = step.run(0, [])
    assert m["time/weight_sync_s"] >= SYNC_S
    assert m["time/step_s"] == pytest.approx(sum(v for k, v in m.items() if k.startswith("time/") and k != "time/step_s"))
