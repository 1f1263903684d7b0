"""PPO's critic warm-up (`rl.critic.warmup_steps`): the steps that do not update the policy log its `loss` and
`grad_norm` as NaN, the metrics loggers' mark of a value not computed, not as 0.0 (a policy loss of exactly 0 is a
real value, e.g. a step whose advantages are all 0, and would show as one in the plots)."""
from __future__ import annotations

import math

import torch

from tests.unit.rl.test_grpo_step_algorithms import _grpo, _pool, _rl


class _WarmingCritic:
    """The critic's interface as the policy update calls it; the policy moves from step `warmup` on."""

    def __init__(self, warmup: int):
        self.warmup = warmup

    def policy_moves(self, step: int) -> bool:
        return step >= self.warmup

    def prepare(self, samples, packs, to_batch) -> dict:
        for s in samples:  # the sequence advantage on every token (the real critic's GAE gives per-token ones)
            s.token_advantages = torch.full((s.response_length,), float(s.advantage))
        return {}

    def update(self, step, samples, packs, to_batch) -> dict:
        return {"critic/value_loss": 0.5}


def test_warmup_steps_log_no_policy_loss():
    pool = _pool(8)
    grpo, _, _ = _grpo(_rl(), pool)
    grpo.policy.critic = _WarmingCritic(warmup=1)
    held = grpo.run(0, pool[:4], prompt_pool=pool)
    moved = grpo.run(1, pool[4:8], prompt_pool=pool)
    assert held["critic/warmup"] == 1.0 and moved["critic/warmup"] == 0.0
    assert math.isnan(held["loss"]) and math.isnan(held["grad_norm"])  # was 0.0 and 0.0
    assert math.isfinite(moved["loss"]) and moved["grad_norm"] > 0
