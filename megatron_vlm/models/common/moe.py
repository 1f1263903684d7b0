"""Mixture-of-Experts block: top-k router, grouped experts, optional shared experts and load balancing.

Router (`TopKRouter`, weight `[E, hidden]`, logits in fp32):
- `score_func="sigmoid"` (NemotronH, DeepSeek-V3): scores = sigmoid(logits); the choice adds the
  score-correction bias `e_score_correction_bias` `[E]` (a buffer, used only to pick experts);
  optional grouped selection keeps the `topk_group` best of `n_group` expert groups (group score =
  sum of its two best scores) before the top-k; weights = chosen scores, renormalised when
  `norm_topk_prob`, times `routed_scaling_factor`.
- `score_func="softmax"` (Qwen3-MoE): scores = softmax(logits); top-k; renormalised when
  `norm_topk_prob`.
Experts (`GroupedExperts`): weights stored `[E, out, in]` as transformers does (`up_proj` or the
fused `gate_up_proj` = [gate; up], `down_proj`); compute = `kernels.moe_permute` ->
`kernels.grouped_mm` -> activation -> `kernels.grouped_mm` -> `kernels.moe_unpermute` (combine
with the routing weights, fp32 accumulation).

Load balancing (auxiliary-loss-free, DeepSeek-V3 / seed 002): every forward in training adds the
per-expert token counts to `step_load` (and `report_load`); after the optimizer step the trainer
sums `step_load` over data-parallel ranks (model code does no communication) and calls
`update_bias(rate)`: bias_e += rate * sign(mean_load - load_e), centred to zero mean, so
under-used experts become more likely to be chosen. `aux_loss_coef > 0` adds the Switch-style loss
E * sum_e f_e * P_e (f = fraction of routed assignments, P = mean router probability), exposed as
`last_aux_loss` for the trainer to add. `moe_load_metrics` / `moe_load_table` turn the report
counts of all MoE layers into the `moe/*` metrics and the per-layer expert-load table.
`MoEConfig` is the `[moe]` config section and `MoELoadBalancer` the trainer-side driver of all this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": relu2,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class TopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "sigmoid",
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        score_correction_bias: bool = True,
    ) -> None:
        super().__init__()
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"TopKRouter: score_func must be sigmoid or softmax, got {score_func!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k {top_k} must be in 1..num_experts ({num_experts})")
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(
                f"TopKRouter: n_group {n_group} must divide num_experts {num_experts} and topk_group "
                f"{topk_group} be in 1..n_group"
            )
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"TopKRouter: top_k {top_k} exceeds the experts of {topk_group} kept groups")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        # The score-correction bias stays fp32 whatever dtype the model is cast to (as transformers keeps
        # it): bias updates of ~1e-3 would vanish in bf16.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def forward(self, x: torch.Tensor):
        """x `[N, hidden]` -> (scores `[N, E]` fp32, topk_weights `[N, k]` fp32, topk_ids `[N, k]`)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], -math.inf).view(-1, self.num_experts)
        topk_ids = choice.topk(self.top_k, dim=-1).indices
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return scores, topk_weights * self.routed_scaling_factor, topk_ids


class GroupedExperts(nn.Module):
    """E experts of the same shape; `gated` = SwiGLU-style act(gate) * up (fused gate_up_proj), else act(up)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str, gated: bool) -> None:
        super().__init__()
        self.num_experts, self.gated = num_experts, gated
        self.act = activation_fn(activation)
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x `[N, hidden]` -> (combined output `[N, hidden]`, tokens_per_expert `[E]`)."""
        permuted, row_map, tokens_per_expert = kernels.moe_permute(x, topk_ids, num_experts=self.num_experts)
        if self.gated:
            gate, up = kernels.grouped_mm(
                permuted, self.gate_up_proj, tokens_per_expert=tokens_per_expert, weight_layout="enk"
            ).chunk(2, dim=-1)
            mid = self.act(gate) * up
        else:
            mid = self.act(kernels.grouped_mm(permuted, self.up_proj, tokens_per_expert=tokens_per_expert, weight_layout="enk"))
        out = kernels.grouped_mm(mid, self.down_proj, tokens_per_expert=tokens_per_expert, weight_layout="enk")
        return kernels.moe_unpermute(out, row_map, topk_weights), tokens_per_expert


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, + NemotronH latent projections) over the last dim."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        activation: str,
        gated_experts: bool,
        score_func: str = "sigmoid",
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        score_correction_bias: bool = True,
        shared_experts: Optional[nn.Module] = None,
        latent_size: Optional[int] = None,
        latent_bias: bool = False,
        aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(
            hidden_size, num_experts, top_k, score_func=score_func, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
            score_correction_bias=score_correction_bias,
        )
        expert_dim = latent_size if latent_size is not None else hidden_size
        self.experts = GroupedExperts(num_experts, expert_dim, moe_intermediate_size, activation=activation, gated=gated_experts)
        self.shared_experts = shared_experts
        if latent_size is not None:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=latent_bias)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=latent_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.aux_loss_coef = aux_loss_coef
        self.last_aux_loss: Optional[torch.Tensor] = None
        # Load counters (int64, not checkpointed, not cast by .to(dtype)): since the last bias update /
        # since the last report. Created lazily on the router's device (works after meta init).
        self._loads: Dict[str, torch.Tensor] = {}

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    def _load(self, name: str) -> torch.Tensor:
        device = self.gate.weight.device
        t = self._loads.get(name)
        if t is None or t.device != device:
            t = self._loads[name] = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return t

    @property
    def step_load(self) -> torch.Tensor:
        """Tokens routed to each expert since the last `update_bias` (int64 `[E]`; sum it over DP ranks before updating)."""
        return self._load("step")

    @property
    def report_load(self) -> torch.Tensor:
        """Tokens routed to each expert since the last `moe_load_report` (int64 `[E]`)."""
        return self._load("report")

    @torch.no_grad()
    def reset_parameters(self, initializer_range: float = 0.02) -> None:
        nn.init.normal_(self.gate.weight, std=initializer_range)
        if self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias.zero_()
        for p in (getattr(self.experts, "up_proj", None), getattr(self.experts, "gate_up_proj", None), self.experts.down_proj):
            if p is not None:
                nn.init.normal_(p, std=initializer_range)
        for lin in (self.fc1_latent_proj, self.fc2_latent_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=initializer_range)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, *, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x `[..., hidden]`; `token_mask` (same leading shape, True = real token) excludes padding from the load counts."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, topk_weights, topk_ids = self.gate(flat)
        routed_in = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed, tokens_per_expert = self.experts(routed_in, topk_ids, topk_weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        # Count once per real forward: activation checkpointing re-runs this forward inside backward
        # (the autograd engine then has a current graph task), which must not count twice.
        if self.training and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                if token_mask is not None:
                    keep = token_mask.reshape(-1).bool()
                    counts = torch.bincount(topk_ids[keep].reshape(-1), minlength=self.num_experts)
                else:
                    counts = tokens_per_expert
                self.step_load.add_(counts)
                self.report_load.add_(counts)
            if self.aux_loss_coef > 0:
                self.last_aux_loss = self.aux_loss_coef * self._switch_aux_loss(scores, tokens_per_expert, topk_ids.shape[1])
        return out

    def _switch_aux_loss(self, scores: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
        probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores need normalising per token
        fraction = tokens_per_expert.to(probs.dtype) / max(1, scores.shape[0] * top_k)
        return self.num_experts * torch.sum(fraction * probs.mean(0))

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Move each expert's score-correction bias against its load error (sign update, zero mean); reset step_load."""
        bias = self.gate.e_score_correction_bias
        if bias is None:
            raise RuntimeError("MoE.update_bias: this router has no score-correction bias (score_correction_bias=False)")
        load = self.step_load.double()
        if load.sum() > 0:
            delta = rate * torch.sign(load.mean() - load)
            bias += (delta - delta.mean()).to(bias.dtype)
        self.step_load.zero_()


def moe_layers(model: nn.Module) -> List[MoE]:
    """The MoE blocks of a model, in module order (= layer order)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_load_table(layers: Iterable[MoE]) -> List[List[int]]:
    """Per-layer expert token counts since the last report: rows = MoE layers, columns = experts."""
    return [[int(v) for v in layer.report_load.tolist()] for layer in layers]


def moe_load_metrics(layers: Iterable[MoE]) -> Dict[str, float]:
    """`moe/entropy_mean` (mean over layers of the entropy, in nats, of the expert-load distribution;
    log E = perfectly balanced), `moe/max_fraction_max` (largest share of routed assignments any
    expert got, over layers), `moe/tokens_per_layer_mean` (routed tokens per layer = assignments / k),
    from the report counters; {} when nothing was routed."""
    entropies, max_fractions, tokens = [], [], []
    for layer in layers:
        load = layer.report_load.double()
        total = float(load.sum())
        if total <= 0:
            continue
        frac = load / total
        nonzero = frac[frac > 0]
        entropies.append(float(-(nonzero * nonzero.log()).sum()))
        max_fractions.append(float(frac.max()))
        tokens.append(total / layer.gate.top_k)
    if not entropies:
        return {}
    return {
        "moe/entropy_mean": sum(entropies) / len(entropies),
        "moe/max_fraction_max": max(max_fractions),
        "moe/tokens_per_layer_mean": sum(tokens) / len(tokens),
    }


def moe_load_report(layers: Iterable[MoE], *, reset: bool = True):
    """(metrics, per-layer expert-load table) since the last report; resets the report counters.
    Call every `n_step_per_workload_report` steps (after summing `report_load` over ranks)."""
    layers = list(layers)
    metrics, table = moe_load_metrics(layers), moe_load_table(layers)
    if reset:
        for layer in layers:
            layer.report_load.zero_()
    return metrics, table


@dataclass(kw_only=True)
class MoEConfig:
    """`[moe]` config section: auxiliary-free load balancing and workload reporting (seed 002's knobs)."""

    enable_moe_load_balancing_training: bool = True
    """After every optimizer step move each expert's score-correction bias against its load error
    (bias += rate * sign(mean load - load), DeepSeek-V3); the bias only affects which experts are picked."""
    bias_update_rate: float = 1e-3
    """Step size of the bias update (DeepSeek-V3 uses 1e-3)."""
    n_step_per_workload_report: int = 10
    """Report `moe/entropy_mean`, `moe/max_fraction_max`, `moe/tokens_per_layer_mean` and the per-layer
    expert-load table every N optimizer steps (0 = never)."""
    aux_loss_coef: float = 0.0
    """Weight of the optional Switch-style auxiliary balance loss added to the training loss (0 = off)."""

    def validate(self) -> None:
        if self.bias_update_rate < 0:
            raise ValueError(f"bias_update_rate: must be >= 0, got {self.bias_update_rate}")
        if self.n_step_per_workload_report < 0:
            raise ValueError(f"n_step_per_workload_report: must be >= 0, got {self.n_step_per_workload_report}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef: must be >= 0, got {self.aux_loss_coef}")


class MoELoadBalancer:
    """What the trainer calls around each optimizer step for the model's MoE layers.

    * `aux_loss()` after the forward: the summed auxiliary loss (None when off) to add to the loss;
    * `after_step(step)` after `optimizer.step()`: sums the step's expert loads over data-parallel
      ranks with the injected `all_reduce` (in place, SUM; model code does no communication), updates
      the biases, and every `n_step_per_workload_report` steps returns `(metrics, table)` for the
      loggers (None otherwise).
    """

    def __init__(self, model: nn.Module, cfg: MoEConfig, *, all_reduce: Optional[Callable[[torch.Tensor], None]] = None):
        cfg.validate()
        self.cfg = cfg
        self.layers = moe_layers(model)
        self.all_reduce = all_reduce
        for layer in self.layers:
            layer.aux_loss_coef = cfg.aux_loss_coef

    def aux_loss(self) -> Optional[torch.Tensor]:
        losses = [layer.last_aux_loss for layer in self.layers if layer.last_aux_loss is not None]
        for layer in self.layers:
            layer.last_aux_loss = None
        return torch.stack(losses).sum() if losses else None

    def _sum_over_ranks(self, loads: List[torch.Tensor]) -> None:
        if self.all_reduce is None or not loads:
            return
        stacked = torch.stack(loads)
        self.all_reduce(stacked)
        for dst, src in zip(loads, stacked):
            dst.copy_(src)

    @torch.no_grad()
    def after_step(self, step: int):
        if not self.layers:
            return None
        self._sum_over_ranks([layer.step_load for layer in self.layers])
        for layer in self.layers:
            if self.cfg.enable_moe_load_balancing_training and layer.gate.e_score_correction_bias is not None:
                layer.update_bias(self.cfg.bias_update_rate)
            else:
                layer.step_load.zero_()
        every = self.cfg.n_step_per_workload_report
        if every and step % every == 0:
            self._sum_over_ranks([layer.report_load for layer in self.layers])
            return moe_load_report(self.layers)
        return None
