"""The reward-model loss and metrics equal TRL's `RewardTrainer.compute_loss` on the same rewards, values and
gradients: the plain Bradley-Terry loss, with a margin, and with the centring term.

TRL (`trl` in the dev extra) is the reference nobody here wrote. `compute_loss` is called unbound on a stand-in
trainer that holds only the attributes it reads, with a stand-in model whose output logits are the rewards
[chosen rows; rejected rows] (TRL's batch layout); our side gets the same rewards in the packed layout
(chosen and rejected of pair k at sequences 2k and 2k + 1) through `reward_terms`, as the step does.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.reward_trainer import RewardTrainer

from megatron_vlm.training.reward.config import RewardTrainConfig
from megatron_vlm.training.reward.step import reward_terms

pytestmark = pytest.mark.slow  # importing trl (transformers' Trainer, accelerate) takes ~40 s on 2 cores

PAIRS = 7


def _trl(rewards: torch.Tensor, margin: float, center: float):
    """TRL's loss and metrics for the packed rewards [2 x PAIRS] (chosen at even positions)."""
    logits = torch.cat([rewards[0::2], rewards[1::2]]).unsqueeze(-1)
    model = lambda **kwargs: SimpleNamespace(logits=logits)  # noqa: E731
    acc = SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=acc, _tp_size=1, _total_train_tokens=0,
                              args=SimpleNamespace(center_rewards_coefficient=center or None),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = {"input_ids": torch.zeros(2 * PAIRS, 3, dtype=torch.long),
              "attention_mask": torch.ones(2 * PAIRS, 3, dtype=torch.long)}
    if margin:
        inputs["margin"] = torch.full((PAIRS,), margin, dtype=rewards.dtype)
    loss = RewardTrainer.compute_loss(trainer, model, inputs)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("margin, center", [(0.0, 0.0), (0.7, 0.0), (0.0, 0.05), (0.3, 0.01)])
def test_loss_and_metrics_equal_trl_reward_trainer(margin, center):
    g = torch.Generator().manual_seed(int(margin * 10 + center * 100))
    rewards = (2.0 * torch.randn(2 * PAIRS, generator=g, dtype=torch.float64)).requires_grad_(True)
    want, metrics = _trl(rewards, margin, center)
    (g_want,) = torch.autograd.grad(want, rewards)
    batch = {"num_pairs": torch.tensor(PAIRS)}
    losses, sums = reward_terms(RewardTrainConfig(margin=margin, center_rewards_coefficient=center), rewards, batch)
    got = losses.mean()
    (g_got,) = torch.autograd.grad(got, rewards)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    assert want.item() > 0 and g_want.abs().sum() > 0
    assert sums["accuracy"] / PAIRS == pytest.approx(metrics["accuracy"][0])
    assert sums["margin"] / PAIRS == pytest.approx(metrics["margin"][0], rel=1e-9, abs=1e-12)
    mean = (sums["rewards/chosen"] + sums["rewards/rejected"]) / (2 * PAIRS)
    assert mean == pytest.approx(metrics["mean_reward"][0], rel=1e-9, abs=1e-12)


def test_margin_and_centring_change_the_loss():
    rewards = torch.tensor([1.0, 0.5, -0.2, 0.3], dtype=torch.float64)
    batch = {"num_pairs": torch.tensor(2)}
    base = reward_terms(RewardTrainConfig(), rewards, batch)[0]
    assert torch.all(reward_terms(RewardTrainConfig(margin=1.0), rewards, batch)[0] > base)
    assert torch.all(reward_terms(RewardTrainConfig(center_rewards_coefficient=0.1), rewards, batch)[0] > base)
