"""Preference losses by name: DPO (`sigmoid`), IPO and SimPO, selected by `[dpo] loss_type`.

A preference loss maps the summed log-probs of the chosen and rejected responses under the policy and the
frozen reference (None for a reference-free variant) and the response lengths to a per-pair loss. The
functions live with the DPO step (`megatron_vlm/training/dpo/losses.py`, which documents the equations and
is tested against TRL's trainers); they are registered here like every other algorithm family
(`megatron_vlm/rl/algorithms/`, which re-exports this registry), so a new variant is one decorated function:
`@PREFERENCE_LOSSES.register("name")`. The registry is what `dpo.loss_type`
is checked against and what the DPO step calls (training/dpo/step.py). A registered variant is given the
reference log-probs and its metrics' implicit rewards are beta x the log-ratios (TRL's); the reference-free ones
are listed in `training.dpo.losses.REFERENCE_FREE`.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from megatron_vlm.registry import Registry
from megatron_vlm.training.dpo.losses import ipo_loss, sigmoid_loss, simpo_loss

__all__ = ["PREFERENCE_LOSSES", "PreferenceLossFn"]


class PreferenceLossFn(Protocol):
    """`(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *, beta, simpo_gamma)`
    -> per-pair loss `[pairs]`."""

    def __call__(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: Optional[torch.Tensor],
                 ref_rejected_logps: Optional[torch.Tensor], chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *,
                 beta: float, simpo_gamma: float = 0.0) -> torch.Tensor: ...


PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss", "dpo.loss_type")
for _name, _fn in (("sigmoid", sigmoid_loss), ("ipo", ipo_loss), ("simpo", simpo_loss)):
    PREFERENCE_LOSSES.register(_name)(_fn)
