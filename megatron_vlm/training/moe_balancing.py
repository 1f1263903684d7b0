"""Mixture-of-Experts load-balancing policy: the `[moe]` config section and the trainer-side driver.

The model's `MoE` blocks (`megatron_vlm.models.common.moe`) only route and count; what to do with the
counts is decided here, once per optimizer step:

* auxiliary-loss-free balancing (DeepSeek-V3): after the optimizer step the per-expert loads of the
  step (`MoE.expert_load`) are summed over data-parallel ranks (with the collective the trainer
  injects: model code does no communication) and each trained router's score-correction bias moves
  against its load error, `bias_e += rate * sign(mean_load - load_e)`, centred to zero mean, so
  under-used experts become more likely to be picked (the bias only affects the choice, not the combine
  weights); a frozen router (LoRA, `train.train_layers`) keeps its bias, part of the frozen base model;
* optional Switch-style auxiliary loss `coef * E * sum_e f_e * P_e` (f = fraction of routed
  assignments, P = mean router probability), built from the `RouterStats` each training forward
  leaves on the block when `record_router_stats` is set. It is a loss of each forward's whole pack: under
  context parallelism, where each rank of the cp group routes only its chunks of the pack, the counts are
  summed over the group (`token_group`) and each rank contributes its tokens' share of P (see
  `switch_aux_loss`), so a cp run trains as one rank routing the whole pack would;
* workload reports every `n_step_per_workload_report` steps: `moe/*` metrics and the per-layer
  expert-load table, from the loads summed since the last report.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_vlm.errors import ConfigError
from megatron_vlm.models.common.moe import MoE, moe_layers
from megatron_vlm.table_checks import at_least

log = logging.getLogger("megatron_vlm")


MOE_BIAS = "MoE bias"
"""The layer kind (`ModelBundle.layer_kinds`) of MoE routers with a score-correction bias: what balancing moves."""


@dataclass(kw_only=True)
class MoEConfig:
    """`[moe]` config section: auxiliary-free load balancing, the optional auxiliary loss and workload reports."""

    enable_moe_load_balancing_training: bool = True
    """After every optimizer step move each expert's score-correction bias against its load error
    (bias += rate * sign(mean load - load), DeepSeek-V3); the bias only affects which experts are picked. A frozen
    router's bias stays ([lora], train.train_layers without the router): it belongs to the frozen base model."""
    bias_update_rate: float = 1e-3
    """Step size of the bias update (DeepSeek-V3 uses 1e-3); refused with enable_moe_load_balancing_training = false.
    Set with every router frozen ([lora], train.train_layers
    without the routers): refused when the run starts (no bias moves)."""
    n_step_per_workload_report: int = 10
    """Report `moe/entropy_mean`, `moe/max_fraction_max`, `moe/tokens_per_layer_mean` and the per-layer
    expert-load table every N optimizer steps (0 = never), from the loads of those N steps (a checkpoint carries the
    loads of the report in progress: a resumed run reports what the uninterrupted one does)."""
    aux_loss_coef: float = 0.0
    """Weight of the optional Switch-style auxiliary balance loss added to the training loss (0 = off)."""

    def validate(self) -> None:
        at_least(self, 0, "bias_update_rate", "n_step_per_workload_report", "aux_loss_coef")
        if not self.enable_moe_load_balancing_training and self.bias_update_rate != MoEConfig.bias_update_rate:
            raise ValueError(f"bias_update_rate: has no effect with enable_moe_load_balancing_training = false (no bias "
                             f"moves), got {self.bias_update_rate}; remove it")


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, *,
                    token_group: Optional[Any] = None) -> torch.Tensor:
    """E * sum_e f_e * P_e for one block: scores `[N, E]` (normalised per token, since sigmoid scores do
    not sum to 1), f_e = assignments of expert e / (N * top_k), P_e = mean probability of expert e. A forward
    without tokens (N = 0) has nothing to balance: 0 (with the graph), not the NaN of an empty mean.

    `token_group`: the process group whose ranks routed disjoint parts of the same tokens (a context-parallel
    group; collective: every rank of it calls this once per forward). N and the assignments are then the
    group's sums, and this rank returns cp x its tokens' terms, E * sum_e f_e * sum_local(p_e) / N: inside a
    context-parallel layer gradients are carried scaled by cp and averaged over the group
    (parallel/context_parallel.py), so the average of the ranks' gradients is that of the whole pack's loss."""
    num_experts = scores.shape[-1]
    counts = tokens_per_expert.reshape(-1).to(scores.device)
    total, parts = scores.shape[0], 1
    if token_group is not None:  # the group's counts (one host read of the token total: no sync without cp)
        both = torch.cat([counts.to(torch.float64), counts.new_tensor([total], dtype=torch.float64)])
        dist.all_reduce(both, group=token_group)
        counts, total, parts = both[:-1], int(both[-1]), dist.get_world_size(token_group)
    if total == 0:
        return scores.sum() * 0.0
    probs = scores / scores.sum(-1, keepdim=True)
    fraction = counts.to(probs.dtype) / (total * top_k)
    return parts * num_experts * torch.sum(fraction * probs.sum(0)) / total


@torch.no_grad()
def update_correction_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Move each expert's bias against its load error, in place: += rate * sign(mean - load), centred
    (zero-mean change). No change when nothing was routed."""
    load = load.double()
    if load.sum() > 0:
        delta = rate * torch.sign(load.mean() - load)
        bias += (delta - delta.mean()).to(bias.dtype)


def _router_trained(layer: nn.Module) -> bool:
    """Whether the block's router is trained: a frozen one (LoRA, `train.train_layers`) is base model, and so is its
    score-correction bias, which then stays (the PEFT adapter does not hold it; GRPO's reference with LoRA is the
    policy without its adapters)."""
    weight = getattr(layer.gate, "weight", None)
    return weight is None or bool(weight.requires_grad)


def moe_load_table(loads: Sequence[torch.Tensor]) -> list[list[int]]:
    """Per-layer expert token counts: rows = MoE layers, columns = experts."""
    return [[int(v) for v in load.tolist()] for load in loads]


def moe_load_metrics(loads: Sequence[torch.Tensor], top_k: Sequence[int]) -> dict[str, float]:
    """`moe/entropy_mean` (mean over layers of the entropy, in nats, of the expert-load distribution;
    log E = perfectly balanced), `moe/max_fraction_max` (largest share of routed assignments any
    expert got, over layers), `moe/tokens_per_layer_mean` (routed tokens per layer = assignments / k);
    {} when nothing was routed. `loads[i]` are layer i's counts, `top_k[i]` its experts per token."""
    entropies, max_fractions, tokens = [], [], []
    for load, k in zip(loads, top_k):
        load = load.double()
        total = float(load.sum())
        if total <= 0:
            continue
        frac = load / total
        nonzero = frac[frac > 0]
        entropies.append(float(-(nonzero * nonzero.log()).sum()))
        max_fractions.append(float(frac.max()))
        tokens.append(total / k)
    if not entropies:
        return {}
    return {
        "moe/entropy_mean": sum(entropies) / len(entropies),
        "moe/max_fraction_max": max(max_fractions),
        "moe/tokens_per_layer_mean": sum(tokens) / len(tokens),
    }


def check_router_settings(layers: Sequence[MoE], cfg: MoEConfig) -> None:
    """ConfigError for a `moe.bias_update_rate` set when every biased router of `layers` (the whole model's MoE
    blocks) is frozen: no bias would move. Logs how many routers are frozen."""
    biased = [layer for layer in layers if layer.gate.e_score_correction_bias is not None]
    frozen = sum(not _router_trained(layer) for layer in biased)
    if biased and frozen == len(biased) and cfg.enable_moe_load_balancing_training \
            and cfg.bias_update_rate != MoEConfig.bias_update_rate:
        raise ConfigError("moe.bias_update_rate: every MoE router of this run is frozen ([lora] / train.train_layers), "
                          "so no score-correction bias moves and the rate does nothing; remove the key, or train "
                          "the routers (train.train_layers)")
    if frozen and cfg.enable_moe_load_balancing_training:
        log.info("moe: %d of %d MoE routers are frozen ([lora] / train.train_layers): their score-correction biases "
                 "stay as loaded (moe.enable_moe_load_balancing_training moves trained routers' only)",
                 frozen, len(layers))


class MoELoadBalancer:
    """What the trainer calls around each optimizer step for the model's MoE layers.

    * `aux_loss()` after the forward: the summed auxiliary loss (None when off) to add to the loss;
    * `after_step(step)` after `optimizer.step()`: sums the step's expert loads over data-parallel
      ranks with the injected `all_reduce` (in place, SUM; one call per step), updates the biases,
      and every `n_step_per_workload_report` steps returns `(metrics, table)` for the loggers (None
      otherwise).

    Pipeline parallelism: each stage's balancer holds that stage's MoE layers (possibly none) and balances them
    with its stage's loads; a report is of the whole model's layers, gathered in stage order with the injected
    `stages` (an all-gather of picklable objects over the pipeline group, called by every stage at a report step).
    """

    def __init__(self, model: nn.Module, cfg: MoEConfig, *, all_reduce: Optional[Callable[[torch.Tensor], Any]] = None,
                 token_group: Optional[Any] = None, stages: Optional[Callable[[Any], list]] = None):
        """`token_group`: the context-parallel group when the MoE blocks route only this rank's chunks of each pack
        (the auxiliary loss is then the whole pack's, `switch_aux_loss`); None otherwise. `stages`: with pipeline
        parallelism, the gather over the stages (above); the caller then checks the router settings on the whole
        model (`check_router_settings`), since a stage sees only its own routers."""
        cfg.validate()
        self.cfg = cfg
        self.layers: list[MoE] = moe_layers(model)
        self.all_reduce = all_reduce
        self.token_group = token_group
        self.stages = stages
        for layer in self.layers:
            layer.record_router_stats = cfg.aux_loss_coef > 0
        if stages is None:
            check_router_settings(self.layers, cfg)
        # loads summed over ranks since the last report (kept here: reporting is policy, not model state)
        self._report_loads = [torch.zeros_like(layer.expert_load) for layer in self.layers]
        # the layers' names in the model (the same under every layout: FSDP, tp, pipeline stubs keep them)
        where = {id(m): name for name, m in model.named_modules()}
        self.names = [where[id(layer)] for layer in self.layers]

    def aux_loss(self) -> Optional[torch.Tensor]:
        losses = []
        for layer in self.layers:
            stats, layer.router_stats = layer.router_stats, None
            if stats is not None:
                losses.append(self.cfg.aux_loss_coef * switch_aux_loss(stats.scores, stats.tokens_per_expert, stats.top_k,
                                                                       token_group=self.token_group))
        return torch.stack(losses).sum() if losses else None

    def report_state(self) -> dict[str, list[int]]:
        """The loads summed since the last report, by layer name, of the whole model (with pipeline parallelism
        gathered over the stages: collective), for a checkpoint: a run resumed from it then reports the same
        steps' loads as the uninterrupted run, not only those since the resume."""
        mine = {name: [int(v) for v in r.tolist()] for name, r in zip(self.names, self._report_loads)}
        if self.stages is None:
            return mine
        merged: dict[str, list[int]] = {}
        for part in self.stages(mine):
            merged.update(part)
        return merged

    def load_report_state(self, saved: Optional[Mapping[str, Sequence[int]]]) -> None:
        """Continue the loads of `report_state` (a checkpoint's; None or a layer it lacks: from 0)."""
        for i, name in enumerate(self.names):
            loads = (saved or {}).get(name)
            if loads is not None and len(loads) == self._report_loads[i].numel():
                self._report_loads[i] = torch.tensor([int(v) for v in loads], dtype=self._report_loads[i].dtype,
                                                     device=self._report_loads[i].device)

    @torch.no_grad()
    def after_step(self, step: int) -> Optional[tuple[dict, Any]]:
        if not self.layers and self.stages is None:
            return None
        if self.layers:
            loads = torch.stack([layer.expert_load for layer in self.layers])
            if self.all_reduce is not None:
                self.all_reduce(loads)
            for i, (layer, load) in enumerate(zip(self.layers, loads)):
                bias = layer.gate.e_score_correction_bias
                if self.cfg.enable_moe_load_balancing_training and bias is not None and _router_trained(layer):
                    update_correction_bias(bias, load, self.cfg.bias_update_rate)
                layer.reset_expert_load()
                report = self._report_loads[i]
                self._report_loads[i] = report.to(load.device) + load
        every = self.cfg.n_step_per_workload_report
        if every and step % every == 0:
            reports, top_k = self._report_loads, [layer.top_k for layer in self.layers]
            if self.stages is not None:  # every stage's layers, in stage (= layer) order
                parts = self.stages(([r.cpu() for r in reports], top_k))
                reports, top_k = [r for part in parts for r in part[0]], [k for part in parts for k in part[1]]
            self._report_loads = [torch.zeros_like(r) for r in self._report_loads]
            return moe_load_metrics(reports, top_k), moe_load_table(reports)
        return None


@contextmanager
def uncounted_expert_load(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave every MoE block's `expert_load` as it was: for filler forwards (the loss x 0 pack a
    rank runs when it has fewer packs than another), whose tokens are no one's data and must not move the
    correction biases or the reported loads."""
    layers = moe_layers(model)
    saved = [layer.expert_load.clone() for layer in layers]
    try:
        yield
    finally:
        for layer, load in zip(layers, saved):
            layer.expert_load.copy_(load)


__all__ = [
    "check_router_settings", "uncounted_expert_load",
    "MoEConfig", "MoELoadBalancer", "moe_load_metrics", "moe_load_table", "switch_aux_loss", "update_correction_bias",
]
