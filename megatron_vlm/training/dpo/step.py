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
(mean summed log-prob of a response), plus the loop's usual grad_norm, lr, timings. The held-out evaluation
reports the same over the eval split and `preference_accuracy`, the fraction of pairs the policy itself
ranks right (log pi(chosen) > log pi(rejected)): meaningful from step 0, where the implicit rewards are all 0.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.errors import ConfigError
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_sum
from megatron_vlm.training.bad_record_summary import write_bad_record_summary
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.dpo.config import DPOConfig
from megatron_vlm.training.dpo.losses import PREFERENCE_LOSSES, REFERENCE_FREE, implicit_rewards
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.step_guard import StepGuard

__all__ = ["DPOStep", "DPOEvaluator", "preference_terms", "reference_logps"]

log = logging.getLogger("megatron_vlm")

_SUMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected", "preference_accuracy")


def reference_logps(dpo: DPOConfig, reference, batch: dict, split: str = "train"):
    """(reference log p of the chosen, of the rejected responses) of a pack; None for a reference-free variant.
    Scored before the policy's forward, so that the policy's is the last forward before its backward."""
    if dpo.loss_type in REFERENCE_FREE:  # an empty pack is scored too: the LoRA reference forward is collective
        return None
    return reference.pair_logps(batch, split)


def preference_terms(dpo: DPOConfig, logp: torch.Tensor, batch: dict, ref):
    """(per-pair losses, {metric: sum over the pack's pairs}) of one packed forward's log-probs; `ref` from
    `reference_logps`."""
    chosen, rejected, n_chosen, n_rejected = pair_sums(logp.float(), batch)
    ref_c, ref_r = ref if ref is not None else (None, None)
    losses = PREFERENCE_LOSSES[dpo.loss_type](chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta=dpo.beta,
                                              simpo_gamma=dpo.simpo_gamma)
    r_c, r_r = implicit_rewards(dpo.loss_type, chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta=dpo.beta)
    c, r = chosen.detach(), rejected.detach()
    sums = {"loss": float(losses.detach().sum()), "rewards/chosen": float(r_c.sum()), "rewards/rejected": float(r_r.sum()),
            "rewards/margins": float((r_c - r_r).sum()), "rewards/accuracies": float((r_c > r_r).float().sum()),
            "logps/chosen": float(c.sum()), "logps/rejected": float(r.sum()),
            "preference_accuracy": float((c > r).float().sum())}
    return losses, sums


class DPOStep:
    """One DPO optimizer step per `train_step`; evaluation through the `evaluate(step)` callable given."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *, dpo: DPOConfig,
                 reference, bad_records: Optional[BadRecordLog] = None, evaluate=None):
        self.ctx, self.bundle, self.optim, self.metrics, self.loader = ctx, bundle, optim, metrics, loader
        self.dpo, self.reference, self.bad_records, self._evaluate = dpo, reference, bad_records, evaluate
        self._it: Optional[Iterator[dict]] = None
        self.guard = StepGuard.from_config(ctx.cfg.train, ctx.env.device)
        self.empty_steps_skipped = 0

    def load_data_state(self, state: dict, step: int) -> None:  # noqa: ARG002
        self.loader.load_state_dict(state)

    def data_state(self, step: int) -> dict:  # noqa: ARG002
        return self.loader.state_dict()

    def evaluate(self, step: int) -> Optional[dict]:
        return self._evaluate(step) if self._evaluate is not None else None

    def _fetch(self, step: int):
        cfg, env = self.ctx.cfg.train, self.ctx.env
        copies = getattr(self.bundle.dims, "data_copies", 1)
        fetched = 0
        it = self._it
        assert it is not None  # train_step made it
        while True:
            micro = [next(it) for _ in range(cfg.micro_batches_per_step)]
            fetched += len(micro)
            local = [sum(int(m["num_pairs"]) for m in micro), sum(int(m["input_ids"].numel()) for m in micro)]
            g_pairs, g_tokens = (v / copies for v in all_reduce_sum(local, env.device))
            if g_pairs > 0:
                return micro, g_pairs, g_tokens
            self.empty_steps_skipped += 1  # every rank sees the same sums: all fetch again together
            log.warning("step %d: no usable pair in this step's packs (see bad_records.json): taking the next packs",
                        step + 1)
            per_epoch = getattr(self.loader, "packs_per_epoch", 0) // max(1, self.bundle.dims.dp_size)
            if fetched > max(per_epoch, 1):
                raise ConfigError(f"data.train: {fetched} packs in a row without a usable pair (more than an epoch); "
                                  "every pair failed when processed (bad_records.json)")

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        if self._it is None:
            self._it = iter(self.loader)
        env, b = self.ctx.env, self.bundle
        t0 = time.time()
        micro, g_pairs, g_tokens = self._fetch(step)
        sums = dict.fromkeys(_SUMS, 0.0)
        b.wrapper.train()
        for m in micro:
            batch = self.ctx.to_device(m)
            ref = reference_logps(self.dpo, self.reference, batch)
            logp = b.wrapper(batch)
            if int(batch["num_pairs"]) == 0:  # an empty pack: zero loss, but the same collective forward / backward
                loss = logp.sum() * 0.0
            else:
                losses, part = preference_terms(self.dpo, logp, batch, ref)
                loss = losses.sum() / g_pairs * b.dims.dp_size
                for k, v in part.items():
                    sums[k] += v
            if b.moe_balancer is not None:
                aux = b.moe_balancer.aux_loss()
                if aux is not None:
                    loss = loss + aux / len(micro)
            loss.backward()
        grad_norm = clip_grad_norm_(b.trainable_params, self.ctx.cfg.train.max_grad_norm)
        lr = self.optim.scheduler.get_last_lr()[0]
        if self.guard.allow(sums["loss"], grad_norm, step=step + 1):
            self.optim.optimizer.step()
        self.optim.scheduler.step()
        self.optim.optimizer.zero_grad(set_to_none=True)
        moe_report = b.moe_balancer.after_step(step + 1) if b.moe_balancer is not None else None
        copies = getattr(b.dims, "data_copies", 1)
        totals = all_reduce_sum([sums[k] for k in _SUMS], env.device)
        dt = time.time() - t0
        if moe_report is not None:
            self.metrics.log_moe_table(step + 1, moe_report[1])
        if not log:
            return dict(moe_report[0]) if moe_report is not None else {}
        out = {k: v / copies / g_pairs for k, v in zip(_SUMS, totals)}
        out.update({"grad_norm": float(grad_norm), "lr": lr, "pairs": g_pairs, "tokens_per_s": g_tokens / dt,
                    "step_time_s": dt, "skipped_steps": float(self.guard.skipped), "epoch": getattr(self.loader, "epoch", 0),
                    "data/empty_steps_skipped": float(self.empty_steps_skipped)})
        if moe_report is not None:
            out.update(moe_report[0])
        return out

    def finish(self) -> None:
        write_bad_record_summary(self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main)


class DPOEvaluator:
    """Held-out preference metrics over the eval split's pairs (`train.eval_max_batches` packs per rank at most)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, dpo: DPOConfig, reference, loader, *, max_batches: int = 0):
        self.ctx, self.bundle, self.dpo, self.reference, self.loader = ctx, bundle, dpo, reference, loader
        self.max_batches = max_batches

    @torch.no_grad()
    def __call__(self, step: int) -> Optional[dict]:  # noqa: ARG002
        if self.loader is None:
            return None
        w = self.bundle.wrapper
        was_training = w.training
        w.eval()
        sums = dict.fromkeys(_SUMS, 0.0)
        pairs = 0.0
        try:
            for k, pack in enumerate(self.loader):
                if self.max_batches and k >= self.max_batches:
                    break
                batch = self.ctx.to_device(pack)
                ref = reference_logps(self.dpo, self.reference, batch, split="eval")
                logp = w(batch)
                if int(batch["num_pairs"]) == 0:
                    continue
                _, part = preference_terms(self.dpo, logp, batch, ref)
                pairs += int(batch["num_pairs"])
                for key, v in part.items():
                    sums[key] += v
        finally:
            w.train(was_training)
        copies = getattr(self.bundle.dims, "data_copies", 1)
        totals = all_reduce_sum([pairs, *(sums[k] for k in _SUMS)], self.ctx.env.device)
        n = totals[0]
        if n <= 0:
            return None
        out = {k: v / n for k, v in zip(_SUMS, totals[1:])}
        out["pairs"] = n / copies
        return out
