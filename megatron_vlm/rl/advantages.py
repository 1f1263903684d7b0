"""Group-relative advantages (GRPO).

A GRPO step samples G completions per prompt; a completion's advantage is its reward minus the mean
reward of its group, optionally divided by the group's standard deviation (GRPO; Dr. GRPO drops the
division). Groups whose rewards are all equal carry no signal (every advantage is 0) and can be
dropped from the batch (DAPO's dynamic sampling keeps only informative groups).

Layout: rewards are a flat [P * G] tensor, group-major (the G samples of prompt p are at
p*G ... p*G+G-1), which is the order the rollout engine returns them in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GroupAdvantages", "compute_group_advantages", "advantage_stats"]


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor
    """[P * G] advantage per sample (0 for samples of dropped groups)."""
    keep: torch.Tensor
    """[P * G] bool: sample is trained on (False for samples of dropped groups)."""
    group_mean: torch.Tensor
    """[P] mean reward of each group."""
    group_std: torch.Tensor
    """[P] standard deviation of each group's rewards (unbiased, as torch.std)."""
    num_dropped_groups: int
    """Groups dropped because all their rewards were equal."""


def compute_group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    drop_equal_reward_groups: bool = False,
    eps: float = 1e-6,
    equal_atol: float = 1e-6,
) -> GroupAdvantages:
    """Advantages of a group-major [P * G] reward vector.

    `normalize_std`: A = (r - mean) / (std + eps), with the unbiased std of the group (as TRL and
    verl); otherwise A = r - mean. `drop_equal_reward_groups`: groups whose max - min reward is at
    most `equal_atol` get keep = False. Computed in float32 whatever the input dtype.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a flat [P * G] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size: must be >= 2, got {group_size}")
    n = rewards.numel()
    if n == 0 or n % group_size:
        raise ValueError(f"rewards: {n} samples is not a positive multiple of group_size {group_size}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:5]
        raise ValueError(f"rewards: non-finite reward at sample index {bad}")
    r = rewards.detach().float().view(-1, group_size)
    mean = r.mean(dim=1)
    std = r.std(dim=1)  # unbiased (Bessel), G >= 2
    centred = r - mean[:, None]
    adv = centred / (std[:, None] + eps) if normalize_std else centred
    keep_group = torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    if drop_equal_reward_groups:
        keep_group = (r.max(dim=1).values - r.min(dim=1).values) > equal_atol
        adv = adv * keep_group[:, None]
    keep = keep_group[:, None].expand_as(r).reshape(-1)
    return GroupAdvantages(
        advantages=adv.reshape(-1),
        keep=keep.clone(),
        group_mean=mean,
        group_std=std,
        num_dropped_groups=int((~keep_group).sum().item()),
    )


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
