"""The reward-model step for the training loop, and the held-out pair evaluation.

Data: the DPO pipeline's packs of whole pairs (data/preference_loader.py): sequences 2k and 2k + 1 of a pack are
pair k's chosen and rejected response to the same prompt with the same images. ONE forward of the `ScoreRoot`
gives a reward per sequence (the last token's hidden state through the scalar head); the per-pair loss is the
Bradley-Terry loss (training/reward/losses.py). As in DPO the step loss is the mean over every pair of the step
on every rank (each micro-batch's sum divided by the global pair count, x dp_size since FSDP averages the
gradients), so the gradient is the one-process, whole-batch gradient of TRL's `RewardTrainer` mean whatever the
world size or accumulation; the pack fetching, empty-pack handling and resume position are DPO's (both are
`training/pair_step.py`'s `PairStep`).

Metrics: `loss`, `accuracy` (the share of pairs whose chosen reward is above the rejected one), `margin` (mean
r_chosen - r_rejected) as TRL's RewardTrainer names them, `rewards/chosen`, `rewards/rejected` (mean rewards of each
side, DPO's spelling: TRL logs min / mean / max_reward over both sides instead), plus the loop's
grad_norm, lr, timings. The held-out evaluation reports the same over the eval split: its `accuracy` is the
held-out pair accuracy (0.5 is chance; at step 0 a fresh head scores near it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.host_copies import host_int
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.pair_step import PackScorer, PairEvaluator, PairStep
from megatron_vlm.training.reward.config import RewardTrainConfig
from megatron_vlm.training.reward.losses import bradley_terry_loss, pair_metrics

__all__ = ["RewardStep", "RewardEvaluator", "pair_rewards"]

_SUMS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


def pair_rewards(rewards: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards [pairs] of a pack's per-sequence rewards (chosen at 2k, rejected at 2k + 1)."""
    n = 2 * host_int(batch["num_pairs"])
    if rewards.shape[0] < n:
        raise ValueError(f"pair_rewards: {rewards.shape[0]} sequence rewards for {n // 2} pairs")
    return rewards[0:n:2], rewards[1:n:2]


def reward_terms(cfg: RewardTrainConfig, rewards: torch.Tensor, batch: dict):
    """(per-pair losses, {metric: sum over the pack's pairs, a 0-d float64 tensor}) of one forward's per-sequence
    rewards."""
    chosen, rejected = pair_rewards(rewards, batch)
    losses = bradley_terry_loss(chosen, rejected, margin=cfg.margin, center_rewards_coefficient=cfg.center_rewards_coefficient)
    sums = {"loss": losses.detach().sum().double(), **pair_metrics(chosen, rejected)}
    return losses, sums


class _RewardPacks(PackScorer):
    """A pack's per-sequence rewards (one forward of the score root) and its Bradley-Terry terms."""

    sums = _SUMS
    reward: RewardTrainConfig

    def pack_forward(self, batch: dict, split: str) -> tuple[torch.Tensor, Any]:  # noqa: ARG002
        return self.bundle.wrapper(batch), None

    def pack_terms(self, out: torch.Tensor, batch: dict, extra: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ARG002
        return reward_terms(self.reward, out, batch)


class RewardStep(_RewardPacks, PairStep):
    """One reward-model optimizer step per `train_step`; data state, pack fetching and evaluation as `DPOStep`."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *,
                 reward: RewardTrainConfig, bad_records: Optional[BadRecordLog] = None, evaluate=None):
        super().__init__(ctx, bundle, optim, metrics, loader, bad_records=bad_records, evaluate=evaluate)
        self.reward = reward


class RewardEvaluator(_RewardPacks, PairEvaluator):
    """Held-out pair metrics over the eval split (`train.eval_max_batches` packs per rank at most)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, reward: RewardTrainConfig, loader, *, max_batches: int = 0):
        super().__init__(ctx, bundle, loader, max_batches=max_batches)
        self.reward = reward
