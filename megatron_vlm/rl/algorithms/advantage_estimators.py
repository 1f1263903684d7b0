"""Advantage estimators by name (`[rl] advantage`), and the frozen spec of a run's advantages.

An estimator maps a group-major reward matrix [P, G] (G completions per prompt) to advantages of the same
shape; the equations are in the module docstring of `megatron_vlm.rl.advantages`, which also holds what
every estimator shares (equal-reward groups, dropping, statistics).

Adding an estimator: a function with the `AdvantageFn` signature decorated with
`@register_advantage("name", std_normalisable=...)` (`std_normalisable`: it divides by the group std unless
`normalize_adv_std = false`; otherwise asking it to is refused).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.rl.algorithms.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageFn", "AdvantageSpec", "register_advantage",
           "resolve_normalize_std"]


class AdvantageFn(Protocol):
    """`(r [P, G], *, normalize_std, eps) -> advantages [P, G]`."""

    def __call__(self, r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: AdvantageFn
    std_normalisable: bool
    """Divides by the group std by default (false: defined without the division; asking for it is an error)."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "advantage")


def register_advantage(name: str, *, std_normalisable: bool) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register `fn` as the estimator `name` (the function is returned unchanged)."""
    def add(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(name, fn, std_normalisable))
        return fn
    return add


@register_advantage("grpo", std_normalisable=True)
def grpo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """(r_i - mean) / (std + eps), the unbiased group std (DeepSeekMath); r_i - mean without the std."""
    centred = r - r.mean(dim=1)[:, None]
    return centred / (r.std(dim=1)[:, None] + eps) if normalize_std else centred


@register_advantage("dr_grpo", std_normalisable=False)
def dr_grpo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """r_i - mean (Dr. GRPO: no std division)."""
    return r - r.mean(dim=1)[:, None]


@register_advantage("rloo", std_normalisable=False)
def rloo_advantages(r: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """r_i - mean of the other G - 1 rewards = G / (G - 1) * (r_i - mean) (REINFORCE leave-one-out)."""
    return r - (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


def resolve_normalize_std(estimator: str, normalize_std: Optional[bool]) -> bool:
    """Whether `estimator` divides by the group std: a std-normalisable one does unless told not to; the others
    never do (asking them to is a ValueError)."""
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est.std_normalisable:
        return True if normalize_std is None else bool(normalize_std)
    if normalize_std:
        raise ValueError(f"normalize_adv_std: advantage = {estimator!r} is defined without the std division "
                         "(leave normalize_adv_std unset or false; advantage = 'grpo' divides by the std)")
    return False


@dataclass(frozen=True)
class AdvantageSpec:
    """A run's advantages, resolved and validated once."""
    estimator: str
    normalize_std: bool
    drop_equal_reward_groups: bool

    def __post_init__(self) -> None:
        resolve_normalize_std(self.estimator, self.normalize_std)  # unknown name / std where not defined: ValueError

    @classmethod
    def from_config(cls, rl: Any) -> AdvantageSpec:
        """From `[rl]`: dynamic sampling drops equal-reward groups too (and refills the step)."""
        return cls(estimator=rl.advantage, normalize_std=resolve_normalize_std(rl.advantage, rl.advantages.normalize_std),
                   drop_equal_reward_groups=rl.advantages.drop_equal_reward_groups or rl.advantages.dynamic_sampling)
