"""Value (critic) losses by name: the registry PPO's critic will select from (no config key reads it yet).

Empty until the PPO value head lands. A value loss maps the critic's predictions, the values of the rollout
(old) critic, the returns and the token mask to a scalar loss and detached metrics; register one with
`@VALUE_LOSSES.register("name")` (e.g. PPO's clipped value loss,
max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2) / 2, aggregated like the policy loss).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from megatron_vlm.rl.algorithms.registry import Registry

__all__ = ["VALUE_LOSSES", "ValueLossFn"]


class ValueLossFn(Protocol):
    """`(values, old_values, returns, mask, *, clip_range, loss_agg, seq_ids) -> (loss, metrics)`."""

    def __call__(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                 clip_range: Optional[float], loss_agg: str,
                 seq_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


VALUE_LOSSES: Registry[ValueLossFn] = Registry("value loss", "value_loss")
