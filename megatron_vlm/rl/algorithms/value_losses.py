"""Value (critic) losses by name (`[rl.critic] value_loss`): what PPO's critic minimises.

A value loss maps the critic's predictions V, the values of the critic that scored the rollout (V_old, before
this step's critic updates), the returns R (GAE's A + V_old) and the token mask to a scalar loss and detached
metrics, reduced like the policy loss (`aggregate_loss`: token-mean, seq-mean, seq-mean-token-sum-norm, with the
mini-batch's global normaliser). Register one with `@VALUE_LOSSES.register("name")`.

    clipped   1/2 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)   (PPO2's value clipping, as in
              OpenAI baselines, TRL and verl); eps = `[rl.critic] value_clip`, 0 = no clipping: 1/2 (V - R)^2
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from megatron_vlm.rl.algorithms.loss_terms import aggregate_loss, masked_mean
from megatron_vlm.rl.algorithms.registry import Registry

__all__ = ["VALUE_LOSSES", "ValueLossFn", "clipped_value_loss"]


class ValueLossFn(Protocol):
    """`(values, old_values, returns, mask, *, clip_range, loss_agg, seq_ids, normalizer, max_response_length)
    -> (loss, metrics)`."""

    def __call__(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                 clip_range: Optional[float], loss_agg: str, seq_ids: Optional[torch.Tensor] = None,
                 normalizer: Optional[float] = None,
                 max_response_length: Optional[int] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


VALUE_LOSSES: Registry[ValueLossFn] = Registry("value loss", "critic.value_loss")


@VALUE_LOSSES.register("clipped")
def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       clip_range: Optional[float], loss_agg: str, seq_ids: Optional[torch.Tensor] = None,
                       normalizer: Optional[float] = None,
                       max_response_length: Optional[int] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (module docstring); `clip_range` None or 0: the plain squared error."""
    if values.shape != old_values.shape or values.shape != returns.shape or values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
                         f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must have one shape")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: must be a bool tensor, got {mask.dtype}")
    if clip_range is not None and clip_range < 0:
        raise ValueError(f"clip_range: must be >= 0 (0 = no clipping), got {clip_range}")
    ret = returns.detach().to(values.dtype)
    old = old_values.detach().to(values.dtype)
    unclipped = (values - ret) ** 2
    if clip_range:
        v_clipped = old + (values - old).clamp(-clip_range, clip_range)
        clipped = (v_clipped - ret) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean(clipped > unclipped, mask)
    else:
        per_token = unclipped
        clip_frac = masked_mean(torch.zeros_like(mask), mask)
    loss = 0.5 * aggregate_loss(per_token, mask, loss_agg, seq_ids=seq_ids, normalizer=normalizer,  # type: ignore[arg-type]
                                max_response_length=max_response_length)
    with torch.no_grad():
        metrics = {"value_loss": loss.detach().float(), "vf_clip_frac": clip_frac,
                   "values_mean": masked_mean(values, mask), "returns_mean": masked_mean(ret, mask),
                   "value_error": masked_mean(unclipped, mask)}
    return loss, metrics
