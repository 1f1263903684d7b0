"""REINFORCE++'s per-token advantages (`[rl] advantage = "reinforce_plus_plus"` / `"reinforce_plus_plus_baseline"`,
Hu et al. 2025), made in the update once the reference log-probs are known, normalised over the whole step.

Why in the update and not with the group advantages: `reinforce_plus_plus` folds the KL penalty into the per-token
reward, r_t = -kl_coef x KL_t + [t = last] score, KL_t = loss.kl_estimator(log pi_old(y_t), log pi_ref(y_t))
(`reinforce_plus_plus_baseline` too with `advantages.kl_in_reward = true`; either without it with false), and
the reference log-probs exist only after the reference forward of the update (as PPO's critic rewards,
rl/critic/rewards.py).

pi_old in KL_t is the policy that generated the samples (REINFORCE++'s and OpenRLHF's: the actor's log-probs when the
experience is made, before any update): `TrainSample.old_logp` in the synchronous loop (the rollout's behaviour
log-probs, or their training-side recompute with `rl.recompute_logprobs`: the same weights), but the behaviour
log-probs `behav_logp` in asynchronous GRPO with stale samples (`asynchronous.max_head_offpolicyness` > 0), where
`old_logp` becomes the proximal policy (the trainer's newer weights) when several mini-batches recompute it; one
update per step or several, the rewards are the same. The score is the completion's group-stage advantage (`TrainSample.advantage`: its reward for
`reinforce_plus_plus`, its reward minus its group's mean for `reinforce_plus_plus_baseline`).

Global normalisation: the mean and the unbiased variance are taken over every trained response token of the step on
every data-parallel rank (one all-reduce of three sums over the data shards), so ranks holding different samples
whiten with the same statistics, and the advantages equal the one-process ones over the concatenated batch:

    A_t = (G_t - mean) / sqrt(var + 1e-8)        (advantages.normalize_std = false: G_t - mean)

as verl's `masked_whiten` over its whole batch (OpenRLHF normalises over all its experiences the same way).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_vlm.rl.algorithms.advantage_estimators import (
    ADVANTAGE_ESTIMATORS,
    GAE_DEFAULT_GAMMA,
    kl_in_reward,
    reinforce_returns,
    resolve_normalize_std,
)
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.rewards import token_rewards
from megatron_vlm.rl.data_shards import DataShards

__all__ = ["BatchAdvantages", "WHITEN_EPS"]

WHITEN_EPS = 1e-8
"""Added to the variance before the square root (verl's `masked_whiten`)."""


class BatchAdvantages:
    """`prepare(samples) -> metrics`: every sample's `token_advantages` (module docstring). `rl`: the `[rl]` section
    (advantage, loss.kl_coef / kl_estimator, advantages.gamma / normalize_std); `shards`: the data shards the
    statistics are summed over."""

    def __init__(self, rl: Any, shards: DataShards):
        est = ADVANTAGE_ESTIMATORS.get(rl.advantage)
        if not est.batch_normalised:
            raise ValueError(f"advantage: {rl.advantage!r} is not a batch-normalised estimator")
        self.shards = shards
        self.kl_coef = float(rl.loss.kl_coef) if kl_in_reward(rl.advantage, rl.advantages.kl_in_reward) else 0.0
        self.kl_estimator = rl.loss.kl_estimator
        # the decoupled loss of asynchronous GRPO: old_logp may be the proximal policy, not the generating one
        self.generating_is_behav = rl.allocation is not None and rl.asynchronous.max_head_offpolicyness > 0
        gamma = rl.advantages.gamma
        self.gamma = GAE_DEFAULT_GAMMA if gamma is None else float(gamma)
        self.whiten = resolve_normalize_std(rl.advantage, rl.advantages.normalize_std)

    def rewards(self, s: TrainSample) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(float64 [response_length] per-token rewards of sample `s`, its summed KL_t as a float32 0-d tensor, None
        without the KL in the reward). The sum stays a tensor: `returns` reads the step's sums at once."""
        ref = s.ref_logp if self.kl_coef > 0 else None
        generating = s.behav_logp if self.generating_is_behav else s.old_logp  # pi_old (module docstring)
        r, kl = token_rewards(s.advantage, s.response_length, old_logp=generating if ref is not None else None,
                              ref_logp=ref, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator)
        return r.double(), kl.sum() if kl is not None else None

    def returns(self, samples: Sequence[TrainSample]) -> tuple[list[torch.Tensor], float]:
        """(float64 [response_length] rewards-to-go of each sample, the summed KL_t of all). One padded batch: the
        recursion over the positions is a Python loop, which a pass per sample would run samples x length times.
        The KL total is one host read for the step (each sample's float32 sum, added in order as Python floats): a
        read per sample is a stream sync each where the log-probs live on the device."""
        parts = [self.rewards(s) for s in samples]
        if not parts:
            return [], 0.0
        width = max(r.numel() for r, _ in parts)
        padded = torch.zeros(len(parts), width, dtype=torch.float64)
        mask = torch.zeros(len(parts), width, dtype=torch.bool)
        for i, (r, _) in enumerate(parts):
            padded[i, :r.numel()] = r
            mask[i, :r.numel()] = True
        g = reinforce_returns(padded, mask, gamma=self.gamma)  # a padded position adds no reward and no discount
        sums = [k for _, k in parts if k is not None]
        kl_total = sum(torch.stack(sums).tolist()) if sums else 0.0
        return [g[i, :r.numel()] for i, (r, _) in enumerate(parts)], kl_total

    def prepare(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Set every sample's `token_advantages` (float32); the step's advantage/* metrics over all ranks (and
        advantage/kl_in_reward, the mean KL_t per token, with the KL in the reward). Collective: every rank calls it,
        with or without samples."""
        gs, kl_local = self.returns(samples)
        flat = torch.cat(gs) if gs else torch.zeros(0, dtype=torch.float64)
        n, a1, a2, kl_sum = self.shards.sum([float(flat.numel()), float(flat.sum()), float((flat * flat).sum()),
                                             kl_local])
        if n == 0:
            for s in samples:  # no response token on any rank: nothing to train, nothing to normalise
                s.token_advantages = torch.zeros(s.response_length)
            return {}
        mean = a1 / n
        var = max(a2 - a1 * a1 / n, 0.0) / max(n - 1, 1)  # unbiased
        scale = 1.0 / math.sqrt(var + WHITEN_EPS) if self.whiten else 1.0
        for s, g in zip(samples, gs):
            s.token_advantages = ((g - mean) * scale).float()
        final = torch.cat([s.token_advantages.double() for s in samples]) if samples else flat  # type: ignore[union-attr]
        f1, f2 = self.shards.sum([float(final.sum()), float((final * final).sum())])
        ext = self.shards.gather((float(final.min()), float(final.max())) if final.numel() else (math.inf, -math.inf))
        out = {"advantage/mean": f1 / n, "advantage/std": math.sqrt(max(f2 - f1 * f1 / n, 0.0) / max(n - 1, 1)),
               "advantage/min": min(p[0] for p in ext), "advantage/max": max(p[1] for p in ext)}
        if self.kl_coef > 0:
            out["advantage/kl_in_reward"] = kl_sum / n
        return out
