"""Mixture-of-Experts block: top-k router, grouped experts, optional shared experts and latent projections.

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

This module is architecture only. How the correction bias is moved, whether an auxiliary balance
loss is added and how loads are reported is training policy (`megatron_vlm.training.moe_balancing`),
which reads what every training forward of a `MoE` block routed through a small interface:

* `MoE.expert_load` — int64 `[E]`: real (unmasked) tokens routed to each expert by training forwards
  since the last `reset_expert_load()` (a forward recomputed by activation checkpointing does not
  count again; eval forwards do not count);
* `MoE.record_router_stats` (default False) — when set, every training forward also leaves its
  `RouterStats` (router scores with their autograd graph, assignments per expert) in
  `MoE.router_stats` for the policy to take; off, nothing is kept alive past the forward.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.models.common.moe_static import experts_static, static_routing_active
from megatron_vlm.models.common.routing_replay import RoutePlan, record_routes


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
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
        fp32_weight: bool = False,
    ) -> None:
        """`fp32_weight`: the weight stays fp32 whatever dtype the model is cast to, and FSDP2 gathers it in fp32
        (parallel/apply.py), as transformers keeps it for families whose checkpoints are made so (Nemotron-H):
        rounding it to bf16 routed 2.5 % of a tiny model's tokens to other experts than transformers' bf16 model."""
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
        self.fp32_weight = fp32_weight
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        # The score-correction bias stays fp32 whatever dtype the model is cast to (as transformers keeps
        # it): bias updates of ~1e-3 would vanish in bf16. An `fp32_weight` keeps its fp32 values (not a cast
        # back from the rounded copy): only the device moves.
        held = self.weight.data if self.fp32_weight and self.weight.dtype == torch.float32 else None
        super()._apply(fn, recurse)
        if held is not None and self.weight.dtype != torch.float32:
            self.weight.data = held.to(device=self.weight.device)
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
        return scores, self.weights_of(scores, topk_ids), topk_ids

    def weights_of(self, scores: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Gate weights `[N, k]` of the experts `topk_ids` from the router's scores: the chosen scores, renormalised
        when `norm_topk_prob`, times `routed_scaling_factor` (also routing replay's weights of recorded experts:
        the bias and the group selection only pick experts, they never weight them)."""
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_weights * self.routed_scaling_factor


class GroupedExperts(nn.Module):
    """E experts of the same shape; `gated` = SwiGLU-style act(gate) * up (fused gate_up_proj), else act(up).

    `expert_mlp` is the per-expert MLP on rows already grouped by expert, with the weights passed in,
    so a module holding a shard of the experts (expert parallelism) runs the same computation on its
    local weights."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str, gated: bool) -> None:
        super().__init__()
        self.num_experts, self.gated = num_experts, gated
        self.act = activation_fn(activation)
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert_mlp(
        self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, first: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        """rows `[n, in]` grouped by expert (`tokens_per_expert` rows each) -> `[n, in]`; `first` is the
        `gate_up_proj` (gated) or `up_proj` weight `[e, out, in]`, `down` the `down_proj` weight."""
        hidden = kernels.grouped_mm(rows, first, tokens_per_expert=tokens_per_expert, weight_layout="enk")
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            mid = self.act(gate) * up
        else:
            mid = self.act(hidden)
        return kernels.grouped_mm(mid, down, tokens_per_expert=tokens_per_expert, weight_layout="enk")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x `[N, hidden]` -> (combined output `[N, hidden]`, tokens_per_expert `[E]`)."""
        permuted, row_map, tokens_per_expert = kernels.moe_permute(x, topk_ids, num_experts=self.num_experts)
        first = self.gate_up_proj if self.gated else self.up_proj
        out = self.expert_mlp(permuted, tokens_per_expert, first, self.down_proj)
        return kernels.moe_unpermute(out, row_map, topk_weights), tokens_per_expert


@dataclass
class RouterStats:
    """What one training forward of a `MoE` block routed, for a balancing policy (e.g. an auxiliary loss).

    `scores` `[N, E]` fp32: the router's probabilities of every token (padding included), with their
    autograd graph; `tokens_per_expert` `[E]`: assignments per expert (N * top_k in all); `top_k`."""

    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    top_k: int


def _routed_eager_under_compile() -> None:
    """`MoE._routed` wrapped in `torch.compiler.disable` (eager under torch.compile), once, as the first block is built.

    Why not the decorator: torch.compiler.disable imports torch._dynamo (~1.7 s), and this module is imported with
    the config package (training/moe_balancing.py), so every config refusal paid for it. Dynamo traces only a built
    block, so the wrap made at the first build is in place for every compile."""
    if not MoE.__dict__.get("_routed_is_eager", False):
        MoE._routed = torch.compiler.disable(MoE.__dict__["_routed"])  # type: ignore[method-assign]
        MoE._routed_is_eager = True


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, + NemotronH latent projections) over the last dim.

    Load statistics for a balancing policy: see the module docstring (`expert_load`,
    `reset_expert_load`, `record_router_stats` / `router_stats`). Routing replay (models/common/routing_replay.py):
    the ids it routes by are recorded inside `recording_routes()`; `route_plan` (set by `replaying_routes`) forces
    recorded experts and counts the routing mismatch."""

    accepts_route_plan = True  # found by routing_replay.replaying_routes
    route_plan: Optional[tuple[RoutePlan, int]] = None
    compile_opaque = True  # `_routed` runs eagerly under torch.compile (parallel/apply.py apply_compile)
    _routed_is_eager = False  # `_routed` wrapped in torch.compiler.disable yet (_routed_eager_under_compile)
    # Under "selective" checkpointing + parallel.compile, each its own checkpoint, the layer compiled around them
    # (parallel/apply.py `_pieces`): the routed experts eager, the rest traced.
    selective_pieces = {"gate": True, "fc1_latent_proj": True, "experts": False, "fc2_latent_proj": True,
                        "shared_experts": True}

    def __init__(
        self,
        hidden_size: int,
        *,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        activation: str,
        gated_experts: bool,
        shared_experts: Optional[nn.Module] = None,
        latent_size: Optional[int] = None,
        latent_bias: bool = False,
        **router_options: Any,
    ) -> None:
        """`router_options`: the `TopKRouter`'s keyword options (score_func, n_group, topk_group, norm_topk_prob,
        routed_scaling_factor, score_correction_bias), its defaults where not given."""
        super().__init__()
        _routed_eager_under_compile()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, **router_options)
        expert_dim = latent_size if latent_size is not None else hidden_size
        self.experts = GroupedExperts(num_experts, expert_dim, moe_intermediate_size, activation=activation, gated=gated_experts)
        self.shared_experts = shared_experts
        if latent_size is not None:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=latent_bias)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=latent_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.record_router_stats = False
        self.router_stats: Optional[RouterStats] = None
        # int64, not checkpointed, not cast by .to(dtype); created lazily on the router's device (works
        # after meta init and follows the module to another device).
        self._expert_load: Optional[torch.Tensor] = None

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    @property
    def expert_load(self) -> torch.Tensor:
        """Real tokens routed to each expert by training forwards since the last `reset_expert_load` (int64 `[E]`)."""
        device = self.gate.weight.device
        if self._expert_load is None or self._expert_load.device != device:
            self._expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return self._expert_load

    def reset_expert_load(self) -> None:
        self.expert_load.zero_()

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
        """x `[..., hidden]`; `token_mask` (same leading shape, True = real token) excludes padding from `expert_load`."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, topk_weights, topk_ids = self.gate(flat)
        routed_in = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = self._routed(routed_in, scores, topk_weights, topk_ids, token_mask)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, routed_in: torch.Tensor, scores: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Routing replay, the routed experts and the load accounting: eager under torch.compile (`parallel.compile`
        compiles the block around it). Why: the grouped GEMMs are sized by the per-expert counts read on the host,
        which change every step (a graph would break there and be recompiled for each new set of counts), and
        the replay / recording scopes and the recomputation check below are host state a graph cannot read."""
        if self.route_plan is not None:
            plan, index = self.route_plan
            recorded = plan.layer(index, routed_in.shape[0], self.top_k)
            plan.count(topk_ids, recorded)
            if plan.force:  # recorded experts, weighted by the current scores (the router keeps its gradient)
                topk_ids = torch.where(recorded[:, :1] >= 0, recorded, topk_ids)
                topk_weights = self.gate.weights_of(scores, topk_ids)
        record_routes(topk_ids, self.num_experts)
        if static_routing_active():  # a static decode step (CUDA graphs): no host-sized GEMMs (moe_static.py)
            routed = experts_static(self.experts, routed_in, topk_ids, topk_weights).to(routed_in.dtype)
            tokens_per_expert = None
        else:
            routed, tokens_per_expert = self.experts(routed_in, topk_ids, topk_weights)

        # Count once per real forward: activation checkpointing re-runs this forward inside backward
        # (the autograd engine then has a current graph task), which must not count twice.
        if self.training and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                if tokens_per_expert is None:  # the static form computes no counts: the same ones, here
                    tokens_per_expert = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
                if token_mask is not None:
                    keep = token_mask.reshape(-1).bool()
                    counts = torch.bincount(topk_ids[keep].reshape(-1), minlength=self.num_experts)
                else:
                    counts = tokens_per_expert
                self.expert_load.add_(counts)
            if self.record_router_stats:
                self.router_stats = RouterStats(scores, tokens_per_expert, topk_ids.shape[1])
        return routed


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE blocks of a model, in module order (= layer order): native `MoE` blocks and the megatron-core
    MoE layers of `parallel.backend = "mcore"` (models/mcore/moe_layer.py), which report the same statistics."""
    return [m for m in model.modules() if isinstance(m, MoE) or getattr(type(m), "reports_expert_load", False)]
