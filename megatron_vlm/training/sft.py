"""The SFT step object for the training loop (`training/loop.py`): `SFTStep`, and the SFT data it
owns — the bad-record log, the synthetic data set (written once by rank 0) and the packed train loader.

Per optimizer step each data-parallel rank takes `micro_batches_per_step` packed micro-batches.
The loss is normalised by the global number of trained (label) tokens of the step, summed over
all ranks and micro-batches — not a mean of per-micro-batch means — so the gradient equals the
one-process, whole-batch gradient whatever the world size. FSDP averages gradients over the dp
ranks, hence the `* dp_size` on each micro-batch loss. With context parallelism the `cp` ranks of a
group read the same packs and compute the same loss (parallel/context_parallel.py): sums over all ranks
are divided by cp.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.data_files import changed_data_file, keep_files_hint
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.plan_lengths import plan_lengths_refusal
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.errors import ConfigError
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_, all_reduce_sum, barrier
from megatron_vlm.training.bad_record_summary import restore_saved_bad_records, save_bad_records, write_bad_record_summary
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.running_totals import RunningTotals
from megatron_vlm.training.signals import StopAgreed
from megatron_vlm.training.step_guard import StepGuard

__all__ = ["SFTStep", "prepare_sft_data", "build_train_loader", "steps_per_epoch"]

log = logging.getLogger("megatron_vlm")

_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}


def prepare_sft_data(ctx: RunContext) -> BadRecordLog:
    """Write the synthetic set once (rank 0; `data.synthetic_dir` defaults to `<run>/data`) and
    return the run's bad-record log, shared by the train and eval loaders."""
    d = ctx.cfg.data
    if d.type == "synthetic_vqa":
        if not d.synthetic_dir:
            d.synthetic_dir = str(ctx.run_dir / "data")
        if ctx.env.is_main:
            write_synthetic_vqa(d.synthetic_dir, d.synthetic_train_size, d.synthetic_eval_size,
                                seed=d.synthetic_seed, image_size=d.synthetic_image_size)
        barrier()
    return BadRecordLog()


def build_train_loader(ctx: RunContext, bundle: ModelBundle, bad_records: BadRecordLog):
    """The endless packed loader of the train split for this data-parallel rank."""
    dp_rank = getattr(bundle.dims, "dp_rank", ctx.env.rank)  # the tp ranks of a group read the same shard
    return build_sft_dataloader(ctx.cfg.data, bundle.processor, seed=ctx.cfg.train.seed, dp_rank=dp_rank,
                                dp_size=bundle.dims.dp_size, split="train", bad_records=bad_records,
                                split_over_ranks=True)  # every rank builds it: each plans 1 / world of the lengths


def steps_per_epoch(loader: Any, dp_size: int, micro_batches_per_step: int) -> float:
    """Optimizer steps per pass over the train split (for `train.epochs`)."""
    return loader.packs_per_epoch / (dp_size * micro_batches_per_step)


_DATA_STATE_KEYS = {"capacity": "data.max_tokens_per_pack", "num_records": "data.train_path", "seed": "train.seed"}
"""The data-state fields a resume compares, and the config key that decides each."""


def data_state_refusal(state: dict, loader, err: ValueError) -> str:
    """One line for a checkpoint whose data position cannot be continued by this run's loader: the config key
    that differs, both values and the two ways forward (keep the old value, or start a fresh run)."""
    fresh = ('or start a fresh run from step 0 (checkpoint.resume = "none" or another train.output_dir; '
             "model.path = an export of the checkpoint keeps its weights)")
    if "global_packs_consumed" not in state:  # a checkpoint whose layout record predates train.mode: another job kind's
        return (f"train.mode: the checkpoint's data state holds no packed-data position (its fields: "
                f"{', '.join(sorted(state)) or 'none'}: written by another job kind, e.g. a GRPO run), so this run cannot "
                f"continue it. Resume it with the train.mode that wrote it, {fresh}")
    changed = changed_data_file(state.get("data_files"), getattr(loader, "data_files", None))
    if changed:  # before the record count: which files differ says more than how many records
        keep = keep_files_hint(state.get("data_files"), getattr(loader, "data_files", None), "data.train_path")
        how = keep or ("Point data.train_path at the checkpoint's data (data.type = \"synthetic_vqa\": its "
                       "data.synthetic_* keys)")
        return (f"data.train_path: {changed}, so the checkpoint's data position would point into other records. "
                f"{how} to resume it, {fresh}")
    now = {"capacity": loader.planner.capacity, "num_records": int(loader.planner.lengths.size), "seed": loader.planner.seed}
    for field, key in _DATA_STATE_KEYS.items():
        if field in state and int(state[field]) != now[field]:
            if field == "num_records":
                return (f"{key}: the checkpoint was written reading {state[field]} train records, this run reads "
                        f"{now[field]} (another data.train_path, or its files changed), so the pack order would "
                        f"differ. Point {key} at the checkpoint's data to resume it, {fresh}")
            return (f"{key}: the checkpoint was written with {key} = {state[field]}, this run has {key} = {now[field]}; "
                    f"the pack order would differ. Set {key} = {state[field]} to resume it, {fresh}")
    shuffle = state.get("shuffle")
    if shuffle is not None and bool(shuffle) != loader.planner.shuffle:  # the file order, or a permutation per epoch
        return (f"data.shuffle: the checkpoint was written with data.shuffle = {str(bool(shuffle)).lower()}, this run "
                f"has data.shuffle = {str(loader.planner.shuffle).lower()}; the pack order would differ. Set data.shuffle "
                f"= {str(bool(shuffle)).lower()} to resume it, {fresh}")
    lengths = plan_lengths_refusal(state.get("plan_lengths"), loader.plan_lengths()) if hasattr(
        loader, "plan_lengths") else None
    if lengths:
        return f"{lengths}, {fresh}"
    g, dp = int(state["global_packs_consumed"]), getattr(loader, "dp_size", None)
    if dp and g % dp:
        return (f"checkpoint.resume: the checkpoint's data position cannot be continued here ({err}); resume it with a "
                f"data-parallel size that divides {g}, {fresh}")
    return (f"checkpoint.resume: the checkpoint's data position cannot be continued here ({err}); resume it where it "
            f"was written, {fresh}")


def moe_report_state(balancer: Any, key: str = "moe_report") -> dict:
    """`{key: the loads since the last MoE workload report}` for a checkpoint's data state ({} without a balancer;
    collective with pipeline parallelism), which `restore_moe_report` gives back to a resumed run's balancer."""
    return {key: balancer.report_state()} if balancer is not None else {}


def restore_moe_report(balancer: Any, state: dict, key: str = "moe_report") -> None:
    if balancer is not None:
        balancer.load_report_state(state.get(key))


def restore_data_state(runner: Any, state: dict) -> None:
    """A packed-data step runner's resume (SFT, the pair trainers): the loader position (exit 2 naming what
    changed when it cannot continue), the records skipped before the checkpoint, the running totals, the MoE
    loads of the workload report in progress."""
    try:
        runner.loader.load_state_dict(state)
    except ValueError as e:  # another data set / pack size / seed / data-parallel split than the checkpoint's
        raise ConfigError(data_state_refusal(state, runner.loader, e)) from None
    restore_saved_bad_records(runner.bad_records, state, same_split=state.get("dp_size") == runner.bundle.dims.dp_size,
                              is_main=runner.ctx.env.is_main)
    runner.totals.restore(state)
    restore_moe_report(getattr(runner.bundle, "moe_balancer", None), state)


def agree_counts(runner: Any, local: Sequence[float], *, first: bool) -> list[float]:
    """`local` (a step's counts) summed over all ranks, and the stop agreement of the step boundary before it.

    Why together: each read of an all-reduce is a stream sync on CUDA, and the step needs its counts before its
    forward anyway (the loss divisor, an empty step's skip), so the ranks' stop flags (training/signals.py) travel
    in the same all-reduce and the loop makes no read of its own after the step (`stop_at_step_start`). On the
    step's first fetch (`first`), a stop asked on any rank puts the fetched packs back (`loader.rewind`: the data
    state is the boundary's again) and raises `StopAgreed` on every rank alike, before anything of the step ran.
    A stop asked while an empty step fetches again waits for the next step's agreement. `runner`: the step object
    (its `ctx`, `loader` and `_it`, the loader's iterator)."""
    *sums, stops = all_reduce_sum([*local, float(runner.ctx.stop.pending())], runner.ctx.env.device)
    if first and stops > 0:
        runner.loader.rewind()
        runner._it = None  # spent: a later step (none, the run stops) would iterate anew from the mark
        raise StopAgreed(f"{int(stops)} rank(s) asked to stop before the step began")
    return sums


def global_loss_and_norm(loss_sum: Any, grad_norm: Any, device: torch.device) -> tuple[float, float]:
    """(the loss sum over all ranks, the gradient norm) as floats, in one read of the device.

    Why one: on CUDA every read of a device value is a stream sync (the host waits for all queued kernels); the step
    needs these two before the optimizer step (the non-finite guard) and nothing else, so the loss sum stays on the
    device through the micro-batches and is all-reduced (a collective only with several ranks) and read with the
    norm. A sum over the ranks is non-finite exactly when one rank's is (NaN / inf propagate; the sums of -log p
    of one step are far from float64's overflow). `loss_sum`: a float or a tensor of one value (the pipeline's
    [1], already summed over its stages)."""
    if torch.is_tensor(loss_sum):
        loss = loss_sum.detach().to(device, torch.float64).reshape(1)
    else:
        loss = torch.tensor([float(loss_sum)], dtype=torch.float64, device=device)
    all_reduce_(loss)
    norm = torch.as_tensor(grad_norm).detach().to(device, torch.float64).reshape(1)
    g_loss, g_norm = torch.cat([loss, norm]).tolist()
    return g_loss, g_norm


def global_sums_and_norm(sums: torch.Tensor, grad_norm: Any, device: torch.device) -> tuple[list[float], float]:
    """(`sums` [K] summed over all ranks, the gradient norm) as floats, in one read of the device: what
    `global_loss_and_norm` does for the SFT loss, for a step that logs several sums (the pair trainers: loss and
    metrics). `sums`: float64, on `device`."""
    vec = sums.detach().to(device, torch.float64).reshape(-1)
    all_reduce_(vec)
    norm = torch.as_tensor(grad_norm).detach().to(device, torch.float64).reshape(1)
    *g_sums, g_norm = torch.cat([vec, norm]).tolist()
    return g_sums, g_norm


def _peak_flops(device: torch.device) -> Optional[float]:
    """The bf16 peak FLOP/s of one of the job's devices, for `mfu`; None off CUDA or for an unknown GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in _PEAK_BF16_FLOPS.items() if k in name), None)


class SFTStep:
    """One SFT optimizer step per `train_step`; evaluation through the `evaluate(step)` callable given
    (held-out loss and answer accuracy, built in `megatron_vlm.eval`)."""

    stop_at_step_start = True
    """The stop agreement rides in the step's counts all-reduce (`agree_counts`): the loop reads no stop flag after
    the step, except where it needs the answer before the next step starts (training/loop.py)."""

    def __init__(self, ctx: RunContext, bundle: ModelBundle, optim: OptimState, metrics, loader, *,
                 total_steps: int, bad_records: Optional[BadRecordLog] = None,
                 evaluate: Optional[Callable[[int], Optional[dict]]] = None):
        self.ctx, self.bundle, self.optim, self.metrics, self.loader = ctx, bundle, optim, metrics, loader
        self.total_steps = total_steps
        self.bad_records = bad_records
        self._evaluate = evaluate
        self._it: Optional[Iterator[dict]] = None
        # the whole model's (a pipeline stage holds only its layers); a stand-in bundle without the count: its model's
        self.n_params = getattr(bundle, "num_params", 0) or sum(p.numel() for p in bundle.model.parameters())
        self.guard = StepGuard.from_config(ctx.cfg.train, ctx.env.device)
        self.empty_steps_skipped = 0
        """Times a step's packs held no trained token and were replaced by the next ones (`_skip_empty`)."""
        self.totals = RunningTotals()
        """skipped_steps, data/empty_steps_skipped, data/samples_seen: counted on from the checkpoint's totals."""
        self.samples_seen = 0.0
        """Samples of the packs this process's steps fetched, summed over the data-parallel ranks (data/samples_seen;
        the loader's own count is this rank's alone)."""

    # ------------------------------------------------------------------ StepRunner
    def load_data_state(self, state: dict, step: int) -> None:  # noqa: ARG002
        restore_data_state(self, state)

    def data_state(self, step: int) -> dict:  # noqa: ARG002
        """The loader position and this rank's skipped records; also writes bad_records.json (collective: every
        rank saves), so a run killed or failed later leaves the summary of everything up to its checkpoint."""
        state = dict(self.loader.state_dict())
        state.update(self.totals.state(self._counts()))
        state.update(moe_report_state(self.bundle.moe_balancer))
        return save_bad_records(state, self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                dp_rank=self._dp_rank())

    def _counts(self) -> dict[str, float]:
        """This process's counters (the logged metrics of the same names before the resumed totals are added)."""
        return {"skipped_steps": float(self.guard.skipped), "data/empty_steps_skipped": float(self.empty_steps_skipped),
                "data/samples_seen": self.samples_seen}

    def evaluate(self, step: int) -> Optional[dict]:
        return self._evaluate(step) if self._evaluate is not None else None

    def train_step(self, step: int, *, log: bool) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        cfg, env, b = self.ctx.cfg.train, self.ctx.env, self.bundle
        t0 = time.time()
        # the tp ranks of a group read the same micro-batches: count each data shard once
        copies = getattr(b.dims, "data_copies", 1)
        fetched = 0
        self.loader.mark()  # a stop agreed at the step's start puts its packs back (`agree_counts`)
        while True:
            micro = [next(self._it) for _ in range(cfg.micro_batches_per_step)]
            fetched += len(micro)
            local = [sum(int(m["num_label_tokens"]) for m in micro), sum(int(m["num_samples"]) for m in micro),
                     sum(int(m["input_ids"].numel()) for m in micro)]
            g_tokens, g_samples, g_seq = (v / copies for v in agree_counts(self, local, first=fetched == len(micro)))
            self.samples_seen += g_samples
            if g_tokens > 0:
                break
            self._skip_empty(step, fetched)  # every rank sees the same sums: all fetch again together
        denom = g_tokens
        loss_sum: Any = 0.0  # this rank's sum of -log p: a float64 device tensor (the pipeline's too, not read)
        b.wrapper.train()
        if b.pipeline is not None:  # parallel.pp > 1: the 1F1B schedule runs forward + backward (parallel/pipeline.py)
            loss_sum = b.pipeline.run([self.ctx.to_device(m) for m in micro], b.dims.dp_size / denom)
        for i, m in enumerate(micro if b.pipeline is None else ()):
            logp = b.wrapper(self.ctx.to_device(m))
            loss = -logp.sum(dtype=torch.float32) / denom * b.dims.dp_size
            if b.moe_balancer is not None:
                aux = b.moe_balancer.aux_loss()
                if aux is not None:
                    loss = loss + aux / len(micro)
            loss.backward()
            part = -logp.detach().sum(dtype=torch.float64)  # kept on the device: no read per micro-batch
            loss_sum = part if i == 0 else loss_sum + part
        clip = clip_grad_norm_ if b.pipeline is None else b.pipeline.clip_grad_norm_  # pp: norm over all stages
        grad_norm = clip(b.trainable_params, cfg.max_grad_norm)
        g_loss_sum, norm = global_loss_and_norm(loss_sum, grad_norm, env.device)
        g_loss_sum /= copies
        lr = self.optim.scheduler.get_last_lr()[0]  # the lr of this step's update (step() moves to the next)
        # non-finite: skip the update, count it. The loss is the sum over all ranks (non-finite when one rank's is)
        if self.guard.allow(g_loss_sum, norm, step=step + 1, loss_is_global=True):
            self.optim.optimizer.step()
        self.optim.scheduler.step()
        self.optim.optimizer.zero_grad(set_to_none=True)
        moe_report = b.moe_balancer.after_step(step + 1) if b.moe_balancer is not None else None
        dt = time.time() - t0
        if moe_report is not None:
            self.metrics.log_moe_table(step + 1, moe_report[1])
        if not log and moe_report is None:
            return {}
        # a step with a MoE workload report logs its whole row, not the moe/* metrics alone: a row of those alone
        # as the CSV's first would fix its header without loss, lr, ... (loggers.py: later keys go to `extra`)
        out = {
            "loss": g_loss_sum / denom,
            "grad_norm": norm,
            "lr": lr,
            "tokens_per_s": g_seq / dt,
            "trained_tokens": g_tokens,
            "samples_per_s": g_samples / dt,
            "epoch": getattr(self.loader, "epoch", 0),
            "step_time_s": dt,
            "skipped_steps": float(self.guard.skipped),
            "data/empty_steps_skipped": float(self.empty_steps_skipped),
        }
        out.update(self._data_stats())
        peak = _peak_flops(env.device)
        if peak:
            out["mfu"] = 6.0 * self.n_params * (g_seq / dt) / (peak * env.world_size)
        if moe_report is not None:
            out.update(moe_report[0])
        return self.totals.add_to(out)

    def _data_stats(self) -> dict[str, float]:
        """data/*: the loader's counts, the counters made the run's (every data-parallel rank's, as trained_tokens and
        samples_per_s are): samples_seen from the step's all-reduce, packs_consumed = this rank's x dp (the ranks take
        the same number of packs). packing_efficiency, planned_packing_efficiency and bad_records are rank 0's."""
        stats = self.loader.stats() if hasattr(self.loader, "stats") else {}
        out = {f"data/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        if "data/packs_consumed" in out:
            out["data/packs_consumed"] *= self.bundle.dims.dp_size
        out["data/samples_seen"] = self.samples_seen
        return out

    def _skip_empty(self, step: int, fetched: int) -> None:
        """No rank's micro-batches of this step hold a trained token: every sample in them failed when it
        was processed (an image whose header read but whose pixels do not decode, a video decoder past
        its timeout; counted in bad_records.json). Updating on them would move the weights by momentum
        and weight decay alone and log a loss of 0, so the step takes the next packs instead (counted
        as `data/empty_steps_skipped`). A whole epoch of packs without one trained token is a
        ConfigError (exit 2): nothing of the split can be trained on."""
        self.empty_steps_skipped += 1
        if self.empty_steps_skipped <= 5:
            log.warning("step %d: no trained token in this step's packs (their samples failed when processed; see "
                        "bad_records.json): taking the next packs instead of updating on nothing", step + 1)
        per_epoch = getattr(self.loader, "packs_per_epoch", 0) // max(1, self.bundle.dims.dp_size)
        if fetched > max(per_epoch, 1):
            self.finish()  # collective (every rank gets here at once): bad_records.json lists what stopped the run
            raise ConfigError(f"data.train_path: {fetched} packs in a row without a trained token (more than an epoch, "
                              f"{per_epoch} packs per rank): every sample failed when processed; see "
                              f"{self.bad_records.counts_by_category() if self.bad_records is not None else 'the log'}")

    def finish(self) -> None:
        """Gather every rank's skipped records and write one summary (rank 0)."""
        write_bad_record_summary(self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                 dp_rank=self._dp_rank())

    def _dp_rank(self) -> int:
        return getattr(self.bundle.dims, "dp_rank", self.ctx.env.rank)  # as build_train_loader shards the data
