"""The Bradley-Terry pairwise loss of reward-model training, per pair.

    loss_k = -log sigmoid(r_chosen_k - r_rejected_k - margin) + c * (r_chosen_k + r_rejected_k)^2

(Bradley & Terry 1952; the reward-model objective of Ouyang et al. 2022, eq. 1, with Llama 2's margin and
the centring term of Eisenstein et al. 2023, c = `center_rewards_coefficient`). The step averages it over
every pair of the optimizer step, which is the mean TRL's `RewardTrainer.compute_loss` takes over its batch
(tests/unit/training/test_reward_loss_trl.py checks the two are equal, values and gradients).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bradley_terry_loss", "pair_metrics"]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: float = 0.0,
                       center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """[pairs] losses from the [pairs] rewards of the chosen and the rejected responses."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    return loss


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the pairs (the step divides by the global pair count), 0-d float64 tensors left on the device:
    TRL's `accuracy` (chosen scored above rejected) and `margin`, the mean rewards of each side."""
    c, r = chosen.detach().double(), rejected.detach().double()
    return {"accuracy": (c > r).double().sum(), "margin": (c - r).sum(), "rewards/chosen": c.sum(),
            "rewards/rejected": r.sum()}
