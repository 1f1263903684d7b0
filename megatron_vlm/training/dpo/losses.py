"""Preference-optimisation losses: one function per variant, one signature, per-pair losses out.

    losses = PREFERENCE_LOSSES[name](chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                     chosen_tokens, rejected_tokens, beta=beta, simpo_gamma=gamma)

Every argument is a `[pairs]` tensor: the summed log-probabilities of each chosen / rejected response
under the policy and under the frozen reference (None for a reference-free variant), and the number of
response tokens of each. The result is the `[pairs]` loss; the step averages it over the pairs of the
optimizer step (summed over micro-batches and ranks, then divided by the global pair count), which is
the mean TRL's trainers take over their batch.

- `sigmoid` (DPO, Rafailov et al. 2023, eq. 7): -log sigmoid(beta * (Δ_chosen - Δ_rejected)), Δ = log pi -
  log pi_ref summed over the response;
- `ipo` (Azar et al. 2023, eq. 17): ((Δ_chosen / n_chosen - Δ_rejected / n_rejected) - 1 / (2 beta))^2,
  the log-ratios averaged per response token (as TRL's DPOTrainer does, a normalisation the IPO
  authors confirmed to TRL);
- `simpo` (Meng et al. 2024, eq. 6): -log sigmoid(beta * (log pi(chosen) / n_chosen - log pi(rejected) /
  n_rejected) - gamma), reference-free and length-normalised, with the target reward margin `gamma`.

`implicit_rewards` gives the per-response rewards the metrics report (TRL's `rewards/*`): beta x the
log-ratio for the reference-based variants, beta x the length-normalised log-prob for SimPO.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["sigmoid_loss", "ipo_loss", "simpo_loss", "PREFERENCE_LOSSES", "REFERENCE_FREE", "implicit_rewards"]

Tensor = torch.Tensor


def _tokens(n: Tensor) -> Tensor:
    return n.to(torch.float32).clamp(min=1.0)


def _ref(t: Optional[Tensor]) -> Tensor:
    if t is None:
        raise ValueError("this preference loss needs the reference log-probs (got None)")
    return t


def sigmoid_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor],
                 ref_rejected_logps: Optional[Tensor], chosen_tokens: Tensor, rejected_tokens: Tensor, *,  # noqa: ARG001
                 beta: float, simpo_gamma: float = 0.0) -> Tensor:  # noqa: ARG001
    """DPO: -log sigmoid(beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r)))."""
    delta = (chosen_logps - _ref(ref_chosen_logps)) - (rejected_logps - _ref(ref_rejected_logps))
    return -F.logsigmoid(beta * delta)


def ipo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor],
             ref_rejected_logps: Optional[Tensor], chosen_tokens: Tensor, rejected_tokens: Tensor, *,
             beta: float, simpo_gamma: float = 0.0) -> Tensor:  # noqa: ARG001
    """IPO: the per-token log-ratio difference regressed onto 1 / (2 beta)."""
    chosen = (chosen_logps - _ref(ref_chosen_logps)) / _tokens(chosen_tokens)
    rejected = (rejected_logps - _ref(ref_rejected_logps)) / _tokens(rejected_tokens)
    return (chosen - rejected - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor],  # noqa: ARG001
               ref_rejected_logps: Optional[Tensor], chosen_tokens: Tensor, rejected_tokens: Tensor, *,  # noqa: ARG001
               beta: float, simpo_gamma: float = 0.5) -> Tensor:
    """SimPO: -log sigmoid(beta * (mean log pi_c - mean log pi_r) - gamma); the reference is not used."""
    delta = chosen_logps / _tokens(chosen_tokens) - rejected_logps / _tokens(rejected_tokens)
    return -F.logsigmoid(beta * delta - simpo_gamma)


PREFERENCE_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": sigmoid_loss, "ipo": ipo_loss, "simpo": simpo_loss}
"""Loss variant name (`[dpo] loss_type`) -> loss function."""

REFERENCE_FREE = frozenset({"simpo"})
"""Variants that never read the reference log-probs (no reference model is built for them)."""


def implicit_rewards(name: str, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor],
                     ref_rejected_logps: Optional[Tensor], chosen_tokens: Tensor, rejected_tokens: Tensor, *,
                     beta: float) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) rewards of each pair as the metrics report them (detached)."""
    with torch.no_grad():
        if name in REFERENCE_FREE:
            return beta * chosen_logps / _tokens(chosen_tokens), beta * rejected_logps / _tokens(rejected_tokens)
        return beta * (chosen_logps - _ref(ref_chosen_logps)), beta * (rejected_logps - _ref(ref_rejected_logps))
