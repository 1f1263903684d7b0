"""Preference losses by name: the registry DPO-style training will select from (no config key reads it yet).

Empty until preference optimisation lands. A preference loss maps the summed log-probs of the chosen and
rejected responses under the policy and the frozen reference to a per-pair loss and detached metrics;
register one with `@PREFERENCE_LOSSES.register("name")` (e.g. DPO, Rafailov et al. 2023:
-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))).
"""
from __future__ import annotations

from typing import Protocol

import torch

from megatron_vlm.rl.algorithms.registry import Registry

__all__ = ["PREFERENCE_LOSSES", "PreferenceLossFn"]


class PreferenceLossFn(Protocol):
    """`(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta) -> (per-pair loss, metrics)`."""

    def __call__(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                 ref_rejected: torch.Tensor, *, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss", "preference_loss")
