"""The reward-model step for the training loop, and the held-out pair evaluation.

Data: the DPO pipeline's packs of whole pairs (data/preference_loader.py): sequences 2k and 2k + 1 of a pack are
pair k's chosen and rejected response to the same prompt with the same images. ONE forward of the `ScoreRoot`
gives a reward per sequence (the last token's hidden state through the scalar head); the per-pair loss is the
Bradley-Terry loss (training/reward/losses.py). As in DPO the step loss is the mean over every pair of the step
on every rank (each micro-batch's sum divided by the global pair count, x dp_size since FSDP averages the
gradients), so the gradient is the one-process, whole-batch gradient of TRL's `RewardTrainer` mean whatever the
world size or accumulation; the pack fetching, empty-pack handling and resume position are DPO's (`DPOStep`).

Metrics (TRL's names): `loss`, `accuracy` (the share of pairs whose chosen reward is above the rejected one),
`margin` (mean r_chosen - r_rejected), `rewards/chosen`, `rewards/rejected` (mean rewards), plus the loop's
grad_norm, lr, timings. The held-out evaluation reports the same over the eval split: its `accuracy` is the
held-out pair accuracy (0.5 is chance; at step 0 a fresh head scores near it).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_sum
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.dpo.config import DPOConfig
from megatron_vlm.training.dpo.step import DPOStep
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.reward.config import RewardTrainConfig
from megatron_vlm.training.reward.losses import bradley_terry_loss, pair_metrics

__all__ = ["RewardStep", "RewardEvaluator", "pair_rewards"]

_SUMS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


def pair_rewards(rewards: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards [pairs] of a pack's per-sequence rewards (chosen at 2k, rejected at 2k + 1)."""
    n = 2 * int(batch["num_pairs"])
    if rewards.shape[0] < n:
        raise ValueError(f"pair_rewards: {rewards.shape[0]} sequence rewards for {n // 2} pairs")
    return rewards[0:n:2], rewards[1:n:2]


def reward_terms(cfg: RewardTrainConfig, rewards: torch.Tensor, batch: dict):
    """(per-pair losses, {metric: sum over the pack's pairs}) of one forward's per-sequence rewards."""
    chosen, rejected = pair_rewards(rewards, batch)
    losses = bradley_terry_loss(chosen, rejected, margin=cfg.margin, center_rewards_coefficient=cfg.center_rewards_coefficient)
    sums = {"loss": float(losses.detach().sum()), **pair_metrics(chosen, rejected)}
    return losses, sums


class RewardStep(DPOStep):
    """One reward-model optimizer step per `train_step`; data state, pack fetching and evaluation as `DPOStep`."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *,
                 reward: RewardTrainConfig, bad_records: Optional[BadRecordLog] = None, evaluate=None):
        super().__init__(ctx, bundle, optim, metrics, loader, dpo=DPOConfig(), reference=None, bad_records=bad_records,
                         evaluate=evaluate)
        self.reward = reward

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        if self._it is None:
            self._it = iter(self.loader)
        env, b = self.ctx.env, self.bundle
        t0 = time.time()
        micro, g_pairs, g_tokens = self._fetch(step)
        sums = dict.fromkeys(_SUMS, 0.0)
        b.wrapper.train()
        for m in micro:
            batch = self.ctx.to_device(m)
            rewards = b.wrapper(batch)
            if int(batch["num_pairs"]) == 0:  # an empty pack: zero loss, but the same collective forward / backward
                loss = rewards.sum() * 0.0
            else:
                losses, part = reward_terms(self.reward, rewards, batch)
                loss = losses.sum() / g_pairs * b.dims.dp_size
                for k, v in part.items():
                    sums[k] += v
            if b.moe_balancer is not None:
                aux = b.moe_balancer.aux_loss()
                if aux is not None:
                    loss = loss + aux / len(micro)
            loss.backward()
        grad_norm = clip_grad_norm_(b.trainable_params, self.ctx.cfg.train.max_grad_norm)
        lr = self.optim.scheduler.get_last_lr()[0]
        if self.guard.allow(sums["loss"], grad_norm, step=step + 1):
            self.optim.optimizer.step()
        self.optim.scheduler.step()
        self.optim.optimizer.zero_grad(set_to_none=True)
        moe_report = b.moe_balancer.after_step(step + 1) if b.moe_balancer is not None else None
        copies = getattr(b.dims, "data_copies", 1)
        totals = all_reduce_sum([sums[k] for k in _SUMS], env.device)
        dt = time.time() - t0
        if moe_report is not None:
            self.metrics.log_moe_table(step + 1, moe_report[1])
        if not log:
            return dict(moe_report[0]) if moe_report is not None else {}
        out = {k: v / copies / g_pairs for k, v in zip(_SUMS, totals)}
        out.update({"grad_norm": float(grad_norm), "lr": lr, "pairs": g_pairs, "tokens_per_s": g_tokens / dt,
                    "step_time_s": dt, "skipped_steps": float(self.guard.skipped), "epoch": getattr(self.loader, "epoch", 0),
                    "data/empty_steps_skipped": float(self.empty_steps_skipped)})
        if moe_report is not None:
            out.update(moe_report[0])
        return out


class RewardEvaluator:
    """Held-out pair metrics over the eval split (`train.eval_max_batches` packs per rank at most)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, reward: RewardTrainConfig, loader, *, max_batches: int = 0):
        self.ctx, self.bundle, self.reward, self.loader = ctx, bundle, reward, loader
        self.max_batches = max_batches

    @torch.no_grad()
    def __call__(self, step: int) -> Optional[dict]:  # noqa: ARG002
        if self.loader is None:
            return None
        w = self.bundle.wrapper
        was_training = w.training
        w.eval()
        sums = dict.fromkeys(_SUMS, 0.0)
        pairs = 0.0
        try:
            for k, pack in enumerate(self.loader):
                if self.max_batches and k >= self.max_batches:
                    break
                batch = self.ctx.to_device(pack)
                rewards = w(batch)  # every rank runs the same number of forwards (empty packs included)
                if int(batch["num_pairs"]) == 0:
                    continue
                _, part = reward_terms(self.reward, rewards, batch)
                pairs += int(batch["num_pairs"])
                for key, v in part.items():
                    sums[key] += v
        finally:
            w.train(was_training)
        copies = getattr(self.bundle.dims, "data_copies", 1)
        totals = all_reduce_sum([pairs, *(sums[k] for k in _SUMS)], self.ctx.env.device)
        n = totals[0]
        if n <= 0:
            return None
        out = {k: v / n for k, v in zip(_SUMS, totals[1:])}
        out["pairs"] = n / copies
        return out
