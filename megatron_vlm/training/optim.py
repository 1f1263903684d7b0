"""AdamW (torch's, fused where torch has the kernel: CUDA and CPU; else multi-tensor `foreach`; run on the local tensors
of FSDP's DTensors, training/adamw_local.py; with `optimizer.moments_dtype = "bf16"` our AdamW with bf16 moments,
training/adamw_bf16.py) with decay / no-decay groups, the warmup + decay LR
schedule over the run's length (`total_steps`), and `OptimState`, the optimizer / scheduler pair the loops step."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from megatron_vlm.errors import ConfigError
from megatron_vlm.parallel.master_weights import master_weights_of, with_master_weights
from megatron_vlm.training.adamw_local import LocalShardAdamW

if TYPE_CHECKING:
    from megatron_vlm.config import Config
    from megatron_vlm.config.sections import OptimizerConfig, SchedulerConfig, TrainConfig

log = logging.getLogger("megatron_vlm")

FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # torch's fused AdamW kernels that this project runs on


@dataclass
class OptimState:
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR


def total_steps(train_cfg: TrainConfig, steps_per_epoch: Optional[float] = None) -> int:
    """Optimizer steps of the run: `train.max_steps`, or ceil(train.epochs * steps_per_epoch) when
    only `train.epochs` is set (a job kind without an epoch length passes None: max_steps needed)."""
    if train_cfg.max_steps is not None:
        return train_cfg.max_steps
    if steps_per_epoch is None:
        raise ValueError("train.epochs: this job kind needs train.max_steps")
    assert train_cfg.epochs is not None  # Config.validate: max_steps or epochs
    return max(1, int(math.ceil(train_cfg.epochs * steps_per_epoch)))


def build_optim_state(model: torch.nn.Module, ctx_cfg: Config, device_type: str, num_steps: int) -> OptimState:
    """The optimizer over `model`'s trainable parameters and its schedule over `num_steps` steps."""
    optimizer = build_optimizer(model, ctx_cfg.optimizer, device_type, seed=ctx_cfg.train.seed)
    return OptimState(optimizer, build_scheduler(optimizer, ctx_cfg.scheduler, num_steps))


def build_optimizer(model: torch.nn.Module, opt_cfg: OptimizerConfig, device_type: str, *,
                    seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters, biases and 1-D parameters not decayed; `seed` seeds the stochastic
    rounding of bf16 moments (`optimizer.moments_dtype`; a config-less caller's namespace without it gets fp32).
    The fp32-moments optimizer is torch.optim.AdamW (a subclass whose update, bitwise torch's, skips DTensor's
    dispatch: adamw_local.py)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # biases, norm weights and other 1-D parameters are not decayed
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    if not decay and not no_decay:
        raise ConfigError("train.train_layers: no trainable parameters left")
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs: dict[str, Any] = dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    optimizer: torch.optim.Optimizer
    if getattr(opt_cfg, "moments_dtype", "fp32") == "bf16":
        from megatron_vlm.training.adamw_bf16 import AdamWBf16Moments

        # keyed by name: a tied weight held by two pipeline stages (the embedding's name on both) rounds alike there
        names = {p: name for name, p in model.named_parameters() if p.requires_grad}
        optimizer = AdamWBf16Moments(groups, **kwargs, seed=seed, names=names)
    else:
        optimizer = LocalShardAdamW(groups, **kwargs, **adamw_implementation(device_type))
    masters = master_weights_of(model)  # parallel.fsdp = false in bf16: the update runs on the fp32 masters
    return with_master_weights(optimizer, masters) if masters is not None else optimizer


def adamw_implementation(device_type: str) -> dict:
    """`fused=True` where torch ships the fused AdamW kernel for the device (CUDA, and CPU since
    torch 2.4: one kernel per parameter instead of ~10 elementwise ops, measured 4x faster on the demo
    model's parameters), else the multi-tensor `foreach` path. Both are deterministic; fused differs
    from the per-parameter loop by float rounding only (~1 ulp per step)."""
    if device_type in FUSED_ADAMW_DEVICES:
        return {"fused": True}
    return {"foreach": True}


class WarmupDecay:
    """lr multiplier: linear warmup to 1, then cosine / linear decay to min_lr_ratio, or constant.
    A picklable callable (not a lambda) so the scheduler state round-trips through checkpoints."""

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float):
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, max(total, 1), min_ratio

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        if self.kind == "cosine":
            f = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            f = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * f


def build_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: SchedulerConfig, total_steps: int) -> LambdaLR:
    warmup = sched_cfg.warmup_steps or int(round(sched_cfg.warmup_ratio * total_steps))
    warn_long_warmup(sched_cfg, warmup, total_steps)
    return LambdaLR(optimizer, WarmupDecay(sched_cfg.type, warmup, total_steps, sched_cfg.min_lr_ratio))


def warn_long_warmup(sched_cfg: SchedulerConfig, warmup: int, total_steps: int) -> None:
    """One warning when the warmup lasts the whole run: the lr then never decays, and a warmup past the
    last step never reaches optimizer.lr (a 2-step run with 20 warmup steps trains at 1/20 and 2/20 of it).
    A warning, not a refusal: shortened smoke runs of the shipped configs (`--set train.max_steps=4` over
    their 10-20-step warmups, as the integration tests run them) must still run, and with `train.epochs`
    the length is known only after data planning, too late for `--check`."""
    if warmup <= 0 or warmup < total_steps:
        return
    key = "scheduler.warmup_steps" if sched_cfg.warmup_steps else "scheduler.warmup_ratio"
    log.warning("%s: a warmup of %d steps is not shorter than this run's %d optimizer steps (train.max_steps, or "
                "train.epochs over the planned data): the learning rate rises to at most %.3g x optimizer.lr and "
                "never decays; lower %s below the run's length", key, warmup, total_steps,
                min(total_steps, warmup) / warmup, key)


def load_scheduler_state(scheduler: LambdaLR, state: dict) -> None:
    """Resume `scheduler` at the checkpoint's position (steps taken) but keep the schedule the
    current config built (peak lr, warmup, decay kind, total steps, min ratio). LambdaLR's own
    `load_state_dict` would also restore the checkpoint's schedule, so a run resumed with a new
    `train.max_steps` (or lr / warmup) would silently follow the old one — e.g. sit at the final lr
    after the old total. A changed schedule is logged; with an unchanged config this is exact."""
    state = dict(state)
    saved = state.pop("lr_lambdas", None) or []
    current = [dict(vars(f)) if hasattr(f, "__dict__") else None for f in scheduler.lr_lambdas]
    base_lrs = list(scheduler.base_lrs)
    if list(state.get("base_lrs", base_lrs)) != base_lrs or [s for s in saved if s] != [c for c in current if c]:
        log.warning("resume: the lr schedule differs from the checkpoint's (base lrs %s -> %s, schedule %s -> %s); "
                    "continuing at step %s with the current one", state.get("base_lrs"), base_lrs,
                    saved[:1], current[:1], state.get("last_epoch"))
    scheduler.load_state_dict({**state, "base_lrs": base_lrs, "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


_NOT_SETTINGS = ("params", "initial_lr")
"""Param-group entries that are not settings of this run's config (`initial_lr`: the scheduler's bookkeeping)."""


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters (lr, betas, eps, weight_decay, implementation flags) as this run built
    them: taken before a checkpoint is loaded, put back after it by `keep_group_settings`."""
    return [{k: v for k, v in g.items() if k not in _NOT_SETTINGS} for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    """Equal settings (a checkpoint may give a tuple such as betas back as a list)."""
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def keep_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict], *, name: str,
                        scheduled: bool) -> None:
    """Put this run's param-group settings back after a checkpoint's optimizer state was loaded.

    torch's `Optimizer.load_state_dict` takes every param group's hyperparameters from the checkpoint, so a run
    resumed with another `optimizer.weight_decay`, `optimizer.betas` or `optimizer.eps` (or a constant lr such as
    the critic's `rl.critic.lr`) would silently go on with the old values. The moments and step counts stay the
    checkpoint's; the settings are the current config's, and a change is logged. `scheduled`: the lr is the
    scheduler's (`load_scheduler_state` sets it and reports a change), not compared here. With the same number of
    groups only (a layout that regroups parameters is refused before a load)."""
    if len(settings) != len(optimizer.param_groups):
        return
    changed: dict[str, tuple[Any, Any]] = {}
    for group, mine in zip(optimizer.param_groups, settings):
        for key, value in mine.items():
            if key == "lr" and scheduled:
                continue
            if key in group and not _same(group[key], value):
                changed.setdefault(key, (group[key], value))
            group[key] = value
    if changed:
        log.warning("resume: %s settings differ from the checkpoint's (%s); continuing with the current config's",
                    name, ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
