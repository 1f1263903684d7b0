"""The DPO step object for the training loop (`training/loop.py`), and the held-out preference evaluation.

Per optimizer step each data-parallel rank takes `train.micro_batches_per_step` packs of whole pairs
(data/preference_loader.py). Each pack runs ONE policy forward over its chosen and rejected responses
(varlen: `cu_seqlens` keeps the sequences apart); the per-response log-prob sums and token counts, the
reference's (on the fly, or looked up in the precomputed table) and `[dpo] beta` give the per-pair loss of the
configured variant (training/dpo/losses.py). The step loss is the mean over every pair of the step on
every rank: each micro-batch's sum is divided by the global pair count (x dp_size, since FSDP averages
gradients over the data-parallel ranks), so the gradient is the one-process, whole-batch gradient of TRL's
mean, whatever the world size or accumulation.

Metrics (TRL's names): `loss`, `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`
(the fraction of pairs whose chosen reward is above the rejected one), `logps/chosen`, `logps/rejected`
(mean summed log-prob of a response), `preference_accuracy`, the fraction of pairs the policy itself ranks
right (log pi(chosen) > log pi(rejected)): meaningful from step 0, where the implicit rewards are all 0, plus the
loop's usual grad_norm, lr, timings. The held-out evaluation reports the same over the eval split.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.dpo.config import DPOConfig
from megatron_vlm.training.dpo.loss_registry import PREFERENCE_LOSSES
from megatron_vlm.training.dpo.losses import REFERENCE_FREE, implicit_rewards
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.pair_step import PackScorer, PairEvaluator, PairStep

__all__ = ["DPOStep", "DPOEvaluator", "preference_terms", "reference_logps"]

_SUMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected", "preference_accuracy")


def reference_logps(dpo: DPOConfig, reference, batch: dict, split: str = "train"):
    """(reference log p of the chosen, of the rejected responses) of a pack; None for a reference-free variant.
    Scored before the policy's forward, so that the policy's is the last forward before its backward."""
    if dpo.loss_type in REFERENCE_FREE:  # an empty pack is scored too: the LoRA reference forward is collective
        return None
    return reference.pair_logps(batch, split)


def preference_terms(dpo: DPOConfig, logp: torch.Tensor, batch: dict, ref):
    """(per-pair losses, {metric: sum over the pack's pairs, a 0-d float64 tensor}) of one packed forward's
    log-probs; `ref` from `reference_logps`."""
    chosen, rejected, n_chosen, n_rejected = pair_sums(logp.float(), batch)
    ref_c, ref_r = ref if ref is not None else (None, None)
    loss_fn = PREFERENCE_LOSSES.get(dpo.loss_type)  # the shipped variants and any registered one
    losses = loss_fn(chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta=dpo.beta, simpo_gamma=dpo.simpo_gamma)
    r_c, r_r = implicit_rewards(dpo.loss_type, chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta=dpo.beta)
    c, r = chosen.detach(), rejected.detach()
    # 0-d float64 tensors left on the device (the step reads them once per step): each the float32 sum widened
    sums = {"loss": losses.detach().sum(), "rewards/chosen": r_c.sum(), "rewards/rejected": r_r.sum(),
            "rewards/margins": (r_c - r_r).sum(), "rewards/accuracies": (r_c > r_r).float().sum(),
            "logps/chosen": c.sum(), "logps/rejected": r.sum(), "preference_accuracy": (c > r).float().sum()}
    return losses, {k: v.double() for k, v in sums.items()}


class _DPOPacks(PackScorer):
    """A pack's reference log-probs (before the policy's forward) and its preference terms."""

    sums = _SUMS
    dpo: DPOConfig
    reference: Any

    def pack_forward(self, batch: dict, split: str) -> tuple[torch.Tensor, Any]:
        ref = reference_logps(self.dpo, self.reference, batch, split)
        return self.bundle.wrapper(batch), ref

    def pack_terms(self, out: torch.Tensor, batch: dict, extra: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return preference_terms(self.dpo, out, batch, extra)


class DPOStep(_DPOPacks, PairStep):
    """One DPO optimizer step per `train_step`; evaluation through the `evaluate(step)` callable given."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *, dpo: DPOConfig,
                 reference, bad_records: Optional[BadRecordLog] = None, evaluate=None):
        super().__init__(ctx, bundle, optim, metrics, loader, bad_records=bad_records, evaluate=evaluate)
        self.dpo, self.reference = dpo, reference


class DPOEvaluator(_DPOPacks, PairEvaluator):
    """Held-out preference metrics over the eval split's pairs (`train.eval_max_batches` packs per rank at most)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, dpo: DPOConfig, reference, loader, *, max_batches: int = 0):
        super().__init__(ctx, bundle, loader, max_batches=max_batches)
        self.dpo, self.reference = dpo, reference
