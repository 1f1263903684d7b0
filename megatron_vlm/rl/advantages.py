"""Group-relative advantages (`[rl] advantage`) and DAPO's overlong reward shaping.

A GRPO step samples G completions per prompt; a completion's advantage compares its reward with the
other rewards of its group:

    grpo     (r_i - mean) / (std + eps), std the unbiased group std (Shao et al. 2024, DeepSeekMath);
             with normalize_std = false: r_i - mean
    dr_grpo  r_i - mean: no std division, which up-weights near-uniform groups (Dr. GRPO, Liu et al.
             2025, "Understanding R1-Zero-Like Training: A Critical Perspective"; use it with
             loss_agg = "seq-mean-token-sum-norm" for the paper's length-unbiased loss)
    rloo     r_i - mean of the other G - 1 rewards = G / (G - 1) * (r_i - mean) (REINFORCE
             leave-one-out, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
             Optimization for Learning from Human Feedback in LLMs")

    reinforce_plus_plus           r_i (no group baseline), then in the update per-token returns with the KL
             penalty in the reward, whitened over every response token of the step on all ranks
             (REINFORCE++, Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
             Global Advantage Normalization"; rl/batch_advantages.py)
    reinforce_plus_plus_baseline  r_i - mean, then the same global whitening (the KL stays in the loss unless
             advantages.kl_in_reward = true: then per-token returns with it in the reward)

A group of one completion (`rl.batch.group_size = 1`) has advantage 0 under grpo, dr_grpo, rloo and
reinforce_plus_plus_baseline: they refuse it. `gae` (PPO with a critic) takes its advantages from the critic in the
update, `reinforce_plus_plus` its baseline from the whole batch: both run with groups of one.

Groups whose rewards are all equal carry no signal (every advantage is 0): they are counted
(`zero_variance`) and can be dropped from the batch (DAPO's dynamic sampling, Yu et al. 2025, keeps
only informative groups). `overlong_penalty` is DAPO's soft overlong punishment, added to the
reward before the advantages.

Each estimator is one function registered by name (rl/algorithms/advantage_estimators.py).

Layout: rewards are a flat [P * G] tensor, group-major (the G samples of prompt p are at
p*G ... p*G+G-1), which is the order the rollout engine returns them in.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS as _REGISTRY
from megatron_vlm.rl.algorithms.advantage_estimators import resolve_normalize_std

__all__ = ["GroupAdvantages", "compute_group_advantages", "advantage_stats", "overlong_penalty", "ADVANTAGE_ESTIMATORS",
           "default_normalize_std"]

ADVANTAGE_ESTIMATORS = tuple(_REGISTRY.names())
"""The registered estimators (`[rl] advantage`)."""


def default_normalize_std(estimator: str, normalize_std: Optional[bool]) -> bool:
    """Whether `estimator` divides by the group std: grpo does unless told not to; dr_grpo and rloo
    never do (asking them to is a ValueError: that is `grpo`)."""
    return resolve_normalize_std(estimator, normalize_std)


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor
    """[P * G] advantage per sample (0 for samples of dropped groups)."""
    keep: torch.Tensor
    """[P * G] bool: sample is trained on (False for samples of dropped groups)."""
    group_mean: torch.Tensor
    """[P] mean reward of each group."""
    group_std: torch.Tensor
    """[P] standard deviation of each group's rewards (unbiased, as torch.std; NaN for groups of one)."""
    num_dropped_groups: int
    """Groups dropped because all their rewards were equal."""
    zero_variance: Optional[torch.Tensor] = None
    """[P] bool: the group's rewards are all equal (max - min <= equal_atol), dropped or not."""


def compute_group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    estimator: str = "grpo",
    normalize_std: Optional[bool] = None,
    drop_equal_reward_groups: bool = False,
    eps: float = 1e-6,
    equal_atol: float = 1e-6,
    valid: Optional[torch.Tensor] = None,
) -> GroupAdvantages:
    """Advantages of a group-major [P * G] reward vector by `estimator` (module docstring).

    `normalize_std` (grpo only; None = true): A = (r - mean) / (std + eps), with the unbiased std of
    the group (as TRL and verl); otherwise A = r - mean. `drop_equal_reward_groups`: groups whose
    max - min reward is at most `equal_atol` get keep = False. Computed in float32 for float32 or
    lower-precision input, in float64 for float64 input.

    `group_size` 1 (one completion per prompt) only for an estimator that does not need groups (`needs_groups`
    false: `gae`, whose advantages come from the critic): each group's std is then NaN (undefined), every group
    counts as equal-reward (nothing to compare), and dropping those is refused (it would drop every sample).

    `valid` ([P * G] bool, None = all): samples that are not trained and whose reward says nothing about the
    policy (a multi-turn trajectory its environment failed): a group's statistics and advantages are its valid
    members' alone (for a group-relative estimator a group of fewer than 2 carries no signal: zero advantages, zero
    variance); an invalid sample's advantage is 0.
    """
    normalize_std = default_normalize_std(estimator, normalize_std)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a flat [P * G] tensor, got shape {tuple(rewards.shape)}")
    est = _REGISTRY.get(estimator)
    if group_size < (2 if est.needs_groups else 1):
        raise ValueError(f"group_size: advantage = {estimator!r} is relative within each prompt's group and needs "
                         f">= 2 samples per prompt, got {group_size}" if est.needs_groups else
                         f"group_size: must be >= 1, got {group_size}")
    if group_size == 1 and drop_equal_reward_groups:
        raise ValueError("drop_equal_reward_groups: every group of one sample has equal rewards; with group_size = 1 "
                         "it would drop every sample")
    n = rewards.numel()
    if n == 0 or n % group_size:
        raise ValueError(f"rewards: {n} samples is not a positive multiple of group_size {group_size}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:5]
        raise ValueError(f"rewards: non-finite reward at sample index {bad}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.detach().to(dtype).view(-1, group_size)
    mean = r.mean(dim=1)
    # unbiased (Bessel); undefined for groups of one (torch would warn and give NaN)
    std = r.std(dim=1) if group_size >= 2 else torch.full_like(mean, float("nan"))
    group_fn = est.fn  # rl/algorithms/advantage_estimators.py
    # a token estimator (gae): the advantages come from the critic in the update; 0 here (the group statistics,
    # equal-reward groups and dropping still apply)
    adv = group_fn(r, normalize_std=normalize_std, eps=eps) if group_fn is not None else torch.zeros_like(r)
    spread = r.max(dim=1).values - r.min(dim=1).values
    if est.needs_groups:
        # all G rewards identical: a group-relative advantage is 0. Computed, it need not be: the mean of G equal
        # floats can land an ulp off them (e.g. 8 x 0.2), so centred is ~1e-8 and so is std, and grpo's
        # centred / (std + eps) is ~1e-2 — one push up or down for the whole group, from rounding alone
        adv = torch.where((spread == 0)[:, None], torch.zeros_like(adv), adv)
    if valid is not None:
        if valid.shape != rewards.shape:
            raise ValueError(f"valid: expected shape {tuple(rewards.shape)}, got {tuple(valid.shape)}")
        ok = valid.to(torch.bool).view(-1, group_size)
        mean, std = mean.clone(), std.clone()
        for gi in torch.nonzero(~ok.all(dim=1)).flatten().tolist():
            sub = r[gi][ok[gi]][None]
            adv[gi] = 0
            n_ok = sub.shape[1]
            mean[gi] = sub.mean() if n_ok else float("nan")
            std[gi] = sub.std() if n_ok >= 2 else float("nan")
            spread[gi] = sub.max() - sub.min() if n_ok >= 2 else 0.0
            if group_fn is not None and (float(spread[gi]) != 0 if est.needs_groups else n_ok >= 1):
                adv[gi, ok[gi]] = group_fn(sub, normalize_std=normalize_std, eps=eps)[0]
    zero_var = spread <= equal_atol
    keep_group = torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    if drop_equal_reward_groups:
        keep_group = ~zero_var
        adv = adv * keep_group[:, None]
    keep = keep_group[:, None].expand_as(r).reshape(-1)
    return GroupAdvantages(
        advantages=adv.reshape(-1),
        keep=keep.clone(),
        group_mean=mean,
        group_std=std,
        num_dropped_groups=int((~keep_group).sum().item()),
        zero_variance=zero_var,
    )


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, buffer: int, penalty: float) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`: 0 for a response of
    at most max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens:

        R(|y|) = penalty * max(-1, min(0, ((max_new_tokens - buffer) - |y|) / buffer))

    (DAPO's -1 for |y| > L_max is the clamp; generation stops at max_new_tokens, so a response
    reaches at most the end of the ramp)."""
    if buffer < 1 or buffer >= max_new_tokens:
        raise ValueError(f"overlong_buffer: must be in [1, max_new_tokens = {max_new_tokens}), got {buffer}")
    if penalty < 0:
        raise ValueError(f"overlong_penalty: must be >= 0, got {penalty}")
    start = max_new_tokens - buffer
    return [penalty * max(-1.0, min(0.0, (start - int(n)) / buffer)) for n in lengths]


def advantage_stats(advantages: torch.Tensor, keep: torch.Tensor | None = None) -> dict[str, float]:
    """mean / std / min / max of the kept advantages (NaN-free; zeros when nothing is kept)."""
    a = advantages.detach().float().flatten()
    if keep is not None:
        a = a[keep.flatten()]
    if a.numel() == 0:
        return {"advantage/mean": 0.0, "advantage/std": 0.0, "advantage/min": 0.0, "advantage/max": 0.0}
    return {
        "advantage/mean": a.mean().item(),
        "advantage/std": a.std().item() if a.numel() > 1 else 0.0,
        "advantage/min": a.min().item(),
        "advantage/max": a.max().item(),
    }
