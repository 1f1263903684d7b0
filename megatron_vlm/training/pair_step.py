"""The optimizer step and held-out evaluation shared by the trainers on packs of preference pairs (DPO, reward model).

Both take the same packs of whole pairs (data/preference_loader.py) and differ only in what one pack's forward
gives and how it turns into per-pair losses and metric sums: a subclass supplies `pack_forward` (the forward(s)
of one pack, in the order its collectives need) and `pack_terms` (per-pair losses and {metric: sum}) and names
its summed metrics in `sums`. Everything else lives here once: each pack's prompts shared by its pairs where the
model allows (training/pair_prompts.py), fetching a step's packs (skipping steps whose
packs on every rank hold no usable pair), the empty-pack zero loss (an empty pack still runs the same collective
forward / backward), the MoE auxiliary loss, backward, clipping, the step guard, optimizer and scheduler, the
metrics all-reduce and the output dict. The metric sums stay on the device through the packs (`pack_terms` gives
0-d float64 tensors) and are read once per step with the gradient norm, before the optimizer step (on CUDA each
read is a stream sync); a pack's pair count is read from its host copy (megatron_vlm/host_copies.py). The step
loss is the mean over every pair of the step on every rank: each micro-batch's sum is divided by the global pair
count (x dp_size, since FSDP averages gradients over the data-parallel ranks), so the gradient is the one-process,
whole-batch gradient whatever the world size or accumulation.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.errors import ConfigError
from megatron_vlm.host_copies import host_int
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_
from megatron_vlm.training.bad_record_summary import save_bad_records, write_bad_record_summary
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.pair_prompts import pair_sharing, share_pair_prompts
from megatron_vlm.training.running_totals import RunningTotals
from megatron_vlm.training.sft import agree_counts, global_sums_and_norm, moe_report_state, restore_data_state
from megatron_vlm.training.step_guard import StepGuard

__all__ = ["PackScorer", "PairStep", "PairEvaluator"]

log = logging.getLogger("megatron_vlm")


class PackScorer:
    """The two per-pack hooks a pair trainer supplies (a mixin both its step and its evaluator take first)."""

    sums: tuple[str, ...] = ()
    bundle: ModelBundle
    share_prompts: bool = False
    """Whether each pack's pairs run their prompt once (`pair_prompts.pair_sharing`; set at construction)."""

    def _decide_sharing(self, ctx: RunContext) -> None:
        # "dpo" or "reward": its section's prompt_sharing (absent section, or a bare test config: "auto")
        mode = str(getattr(getattr(ctx.cfg, "train", None), "mode", ""))
        setting = getattr(getattr(ctx.cfg, mode, None), "prompt_sharing", "auto") if mode else "auto"
        self.share_prompts, why = pair_sharing(self.bundle, setting, key=f"{mode}.prompt_sharing")
        if ctx.env.rank == 0 and not isinstance(self, PairEvaluator):
            log.info("pair packs: prompts shared %s (%s)", "on" if self.share_prompts else "off", why)

    def prepared(self, pack: dict) -> dict:
        """The loader's pack as the forwards take it: with each pair's prompt shared when `share_prompts`."""
        return share_pair_prompts(pack) if self.share_prompts else pack

    def pack_forward(self, batch: dict, split: str) -> tuple[torch.Tensor, Any]:
        """(the policy / model output of one pack, anything `pack_terms` needs besides it)."""
        raise NotImplementedError

    def pack_terms(self, out: torch.Tensor, batch: dict, extra: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-pair losses, {metric: sum over the pack's pairs, a 0-d float64 tensor on the device}) of a non-empty
        pack's `pack_forward` result."""
        raise NotImplementedError

    def _sum_vector(self, part: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The pack's metric sums in `sums` order, [K] float64 on `device` (nothing read)."""
        return torch.stack([torch.as_tensor(part[k], dtype=torch.float64).to(device).reshape(()) for k in self.sums])


class PairStep(PackScorer):
    """One optimizer step per `train_step` over `train.micro_batches_per_step` packs of pairs per rank;
    evaluation through the `evaluate(step)` callable given."""

    stop_at_step_start = True
    """The stop agreement rides in the step's counts all-reduce (training/sft.py `agree_counts`)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *,
                 bad_records: Optional[BadRecordLog] = None, evaluate=None):
        self.ctx, self.bundle, self.optim, self.metrics, self.loader = ctx, bundle, optim, metrics, loader
        self.bad_records, self._evaluate = bad_records, evaluate
        self._it: Optional[Iterator[dict]] = None
        self.guard = StepGuard.from_config(ctx.cfg.train, ctx.env.device)
        self.empty_steps_skipped = 0
        self.totals = RunningTotals()
        """skipped_steps, data/empty_steps_skipped: counted on from the checkpoint's totals after a resume."""
        self._decide_sharing(ctx)

    def load_data_state(self, state: dict, step: int) -> None:  # noqa: ARG002
        restore_data_state(self, state)

    def data_state(self, step: int) -> dict:  # noqa: ARG002
        """The loader position, the running totals and this rank's skipped records (also written to
        bad_records.json: collective, every rank saves)."""
        counts = {"skipped_steps": float(self.guard.skipped), "data/empty_steps_skipped": float(self.empty_steps_skipped)}
        state = {**self.loader.state_dict(), **self.totals.state(counts), **moe_report_state(self.bundle.moe_balancer)}
        return save_bad_records(state, self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                dp_rank=getattr(self.bundle.dims, "dp_rank", self.ctx.env.rank))

    def evaluate(self, step: int) -> Optional[dict]:
        return self._evaluate(step) if self._evaluate is not None else None

    def _fetch(self, step: int):
        cfg = self.ctx.cfg.train
        copies = getattr(self.bundle.dims, "data_copies", 1)
        fetched = 0
        it = self._it
        assert it is not None  # train_step made it
        self.loader.mark()  # a stop agreed at the step's start puts its packs back (`agree_counts`)
        while True:
            micro = [next(it) for _ in range(cfg.micro_batches_per_step)]
            fetched += len(micro)
            local = [sum(int(m["num_pairs"]) for m in micro), sum(int(m["input_ids"].numel()) for m in micro)]
            g_pairs, g_tokens = (v / copies for v in agree_counts(self, local, first=fetched == len(micro)))
            if g_pairs > 0:
                return micro, g_pairs, g_tokens
            self.empty_steps_skipped += 1  # every rank sees the same sums: all fetch again together
            log.warning("step %d: no usable pair in this step's packs (see bad_records.json): taking the next packs",
                        step + 1)
            per_epoch = getattr(self.loader, "packs_per_epoch", 0) // max(1, self.bundle.dims.dp_size)
            if fetched > max(per_epoch, 1):
                self.finish()  # collective (every rank gets here at once): bad_records.json lists what stopped the run
                raise ConfigError(f"data.train_path: {fetched} packs in a row without a usable pair (more than an epoch); "
                                  "every pair failed when processed (bad_records.json)")

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        if self._it is None:
            self._it = iter(self.loader)
        env, b = self.ctx.env, self.bundle
        t0 = time.time()
        micro, g_pairs, g_tokens = self._fetch(step)
        # this rank's metric sums, [K] float64 on the device, added pack by pack in order (as Python floats were)
        sums = torch.zeros(len(self.sums), dtype=torch.float64, device=env.device)
        b.wrapper.train()
        for m in micro:
            batch = self.ctx.to_device(self.prepared(m))
            out, extra = self.pack_forward(batch, "train")
            if host_int(m["num_pairs"]) == 0:  # an empty pack: zero loss, but the same collective forward / backward
                loss = out.sum() * 0.0
            else:
                losses, part = self.pack_terms(out, batch, extra)
                loss = losses.sum() / g_pairs * b.dims.dp_size
                sums = sums + self._sum_vector(part, env.device)
            if b.moe_balancer is not None:
                aux = b.moe_balancer.aux_loss()
                if aux is not None:
                    loss = loss + aux / len(micro)
            loss.backward()
        grad_norm = clip_grad_norm_(b.trainable_params, self.ctx.cfg.train.max_grad_norm)
        # the one read of the step: the sums over all ranks and the norm (the guard's loss: every rank's, summed)
        totals, norm = global_sums_and_norm(sums, grad_norm, env.device)
        lr = self.optim.scheduler.get_last_lr()[0]
        if self.guard.allow(totals[self.sums.index("loss")], norm, step=step + 1, loss_is_global=True):
            self.optim.optimizer.step()
        self.optim.scheduler.step()
        self.optim.optimizer.zero_grad(set_to_none=True)
        moe_report = b.moe_balancer.after_step(step + 1) if b.moe_balancer is not None else None
        copies = getattr(b.dims, "data_copies", 1)
        dt = time.time() - t0
        if moe_report is not None:
            self.metrics.log_moe_table(step + 1, moe_report[1])
        if not log and moe_report is None:
            return {}  # a step with a MoE workload report logs its whole row (as SFTStep does, for the CSV header)
        out_metrics = {k: v / copies / g_pairs for k, v in zip(self.sums, totals)}
        out_metrics.update({"grad_norm": norm, "lr": lr, "pairs": g_pairs, "tokens_per_s": g_tokens / dt,
                            "step_time_s": dt, "skipped_steps": float(self.guard.skipped),
                            "epoch": getattr(self.loader, "epoch", 0),
                            "data/empty_steps_skipped": float(self.empty_steps_skipped)})
        if moe_report is not None:
            out_metrics.update(moe_report[0])
        return self.totals.add_to(out_metrics)

    def finish(self) -> None:
        write_bad_record_summary(self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                 dp_rank=getattr(self.bundle.dims, "dp_rank", self.ctx.env.rank))


class PairEvaluator(PackScorer):
    """Held-out metrics over the eval split's pairs (`train.eval_max_batches` packs per rank at most); every rank
    runs the same number of forwards (empty packs included), then one all-reduce of the pair count and the sums."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, loader, *, max_batches: int = 0):
        self.ctx, self.bundle, self.loader = ctx, bundle, loader
        self.max_batches = max_batches
        self._decide_sharing(ctx)

    @torch.no_grad()
    def __call__(self, step: int) -> Optional[dict]:  # noqa: ARG002
        if self.loader is None:
            return None
        w = self.bundle.wrapper
        was_training = w.training
        w.eval()
        device = self.ctx.env.device
        sums = torch.zeros(len(self.sums), dtype=torch.float64, device=device)  # on the device: read once, at the end
        pairs = 0.0
        try:
            for k, pack in enumerate(self.loader):
                if self.max_batches and k >= self.max_batches:
                    break
                batch = self.ctx.to_device(self.prepared(pack))
                scores, extra = self.pack_forward(batch, "eval")
                if host_int(pack["num_pairs"]) == 0:
                    continue
                _, part = self.pack_terms(scores, batch, extra)
                pairs += host_int(pack["num_pairs"])
                sums = sums + self._sum_vector(part, device)
        finally:
            w.train(was_training)
        copies = getattr(self.bundle.dims, "data_copies", 1)
        counted = torch.full((1,), pairs, dtype=torch.float64, device=device)
        totals = all_reduce_(torch.cat([counted, sums])).tolist()
        n = totals[0]
        if n <= 0:
            return None
        out = {k: v / n for k, v in zip(self.sums, totals[1:])}
        out["pairs"] = n / copies
        return out
