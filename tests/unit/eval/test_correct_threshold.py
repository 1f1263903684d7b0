"""`correct_threshold` compares verifier scores in [0, 1]: a value outside (0, 1] turns every completion
(0 or below) or none (above 1, NaN) into "correct", so the accuracy is silently 100 % or 0 %."""
from __future__ import annotations

import pytest

from megatron_vlm.config import ConfigError
from megatron_vlm.config.eval_section import EvalConfig
from megatron_vlm.rl.config import RLEvalConfig


def _eval_cfg(**kw) -> EvalConfig:
    from megatron_vlm.config.eval_section import BenchmarkConfig
    return EvalConfig(benchmarks=[BenchmarkConfig(name="b", path="/x", columns={"question": "q", "answer": "a"})], **kw)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_threshold_outside_unit_interval_is_refused(bad):
    for cfg in (_eval_cfg(correct_threshold=bad), RLEvalConfig(correct_threshold=bad)):
        with pytest.raises((ValueError, ConfigError), match="correct_threshold"):
            cfg.validate()


@pytest.mark.parametrize("good", [1.0, 0.5, 1e-6])
def test_threshold_in_unit_interval_is_kept(good):
    _eval_cfg(correct_threshold=good).validate()
    RLEvalConfig(correct_threshold=good).validate()
