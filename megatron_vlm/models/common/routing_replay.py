"""MoE routing replay ("R3"): record the experts a rollout forward chose, route a training forward the same way.

Why: the importance ratio of RL on a MoE policy compares log-probs of two forwards (the rollout engine's and
the trainer's) that may route a token to different experts (other kernels, another batch layout, a moved
score-correction bias, stale weights in asynchronous RL); one flipped expert changes the token's output,
and the ratio explodes. Replay records, per token and MoE layer, the top-k expert ids the rollout used and
makes the training forward use them; the gate weights are recomputed from the CURRENT router scores of those
experts (the router's own normalisation: `TopKRouter.weights_of`), so the router keeps its gradient.

Two context managers, read by every native `MoE` block (models/common/moe.py) and megatron-core MoE layer
(parallel.backend = "mcore": models/mcore/moe_layer.py, through its router's top-k hook) while it runs:

* `recording_routes()` -> `RouteRecorder`: each MoE forward called inside appends its top-k ids `[N, k]`
  (N = its flattened tokens) in call order = layer order; `stacked()` gives `[N, layers, k]` in the compact
  `route_dtype` (int8 up to 128 experts, else int16). The rollout engine records its prefill and decode steps;
* `replaying_routes(model, routes, force=...)` -> `RoutePlan`: `routes` `[N, layers, k]` (-1 rows = no
  recorded route: the token routes itself) in the token order of the forward (a packed sequence: the order
  of `input_ids`); with `force` every MoE block routes each recorded token to its recorded experts, without
  it routing is untouched. Either way the plan counts the (token x layer) pairs whose natural top-k SET
  differs from the recorded one (`mismatch()`): what replay removes, `rollout/routing_mismatch_frac`.
  The plan is attached to the blocks for the whole `with` block, so keep the backward inside it when
  activation checkpointing re-runs forwards there (a recomputation is not counted twice).

Context parallelism (parallel/context_parallel.py): a context-parallel decoder layer runs only its rank's
load-balanced chunks of the pack, so a MoE block inside it sees those tokens, not the pack. The plan keeps the
routes of the whole pack (every cp rank packs the same samples) and hands such a block the recorded rows of
the rank's chunks (`CPPlan.index` of the model's own `ContextParallel`), found by the block's token count:
the pack's count = a layer run whole (a Mamba2 hybrid's unsplit layers, decoding), the chunks' = a split one.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["RouteRecorder", "recording_routes", "record_routes", "route_dtype", "RoutePlan", "replaying_routes",
           "RoutingReplayError", "routes_bytes_per_token", "context_parallel_of", "check_recorded_ids"]

_RECORDER: contextvars.ContextVar[Optional[RouteRecorder]] = contextvars.ContextVar("megatron_vlm_route_recorder",
                                                                                     default=None)


class RoutingReplayError(RuntimeError):
    """A forward whose tokens or MoE layers do not match the recorded routes (a bug in the caller's layout)."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact integer type of a recorded expert id (and the -1 "no route" marker)."""
    return torch.int8 if num_experts <= 128 else torch.int16


def routes_bytes_per_token(num_moe_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes of the recorded routes of one token (what travels with a sample, per prompt or generated token)."""
    return num_moe_layers * top_k * torch.tensor([], dtype=route_dtype(num_experts)).element_size()


class RouteRecorder:
    """The top-k ids of the MoE forwards run inside `recording_routes()`, in call order."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.num_experts = 0

    def append(self, topk_ids: torch.Tensor, num_experts: int) -> None:
        self.calls.append(topk_ids.to(route_dtype(num_experts)))
        self.num_experts = max(self.num_experts, num_experts)

    def stacked(self) -> Optional[torch.Tensor]:
        """`[N, layers, k]` of the recorded calls (None: no MoE forward ran). Graph-safe (no host read)."""
        if not self.calls:
            return None
        if len({tuple(c.shape) for c in self.calls}) != 1:
            raise RoutingReplayError(f"recorded MoE calls of different shapes {[tuple(c.shape) for c in self.calls]}")
        return torch.stack(self.calls, dim=1)


@contextlib.contextmanager
def recording_routes() -> Iterator[RouteRecorder]:
    """MoE blocks called inside record their top-k ids into the yielded `RouteRecorder`."""
    rec = RouteRecorder()
    token = _RECORDER.set(rec)
    try:
        yield rec
    finally:
        _RECORDER.reset(token)


def record_routes(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Called by a MoE block with the ids it routed by: kept when a recorder is active."""
    rec = _RECORDER.get()
    if rec is not None:
        rec.append(topk_ids, num_experts)


class RoutePlan:
    """The recorded routes of one training forward and the routing-mismatch counts of its MoE blocks."""

    def __init__(self, routes: torch.Tensor, force: bool, local_index: Optional[torch.Tensor] = None) -> None:
        """`local_index`: the pack rows a context-parallel layer of this rank runs (module docstring), or None."""
        if routes.dim() != 3:
            raise RoutingReplayError(f"routes: expected [tokens, layers, k], got {tuple(routes.shape)}")
        self.routes, self.force = routes, force
        self.local_index = None if local_index is None else local_index.to(routes.device)
        self._counts = torch.zeros(2, dtype=torch.int64, device=routes.device)  # (differing, recorded) pairs

    def layer(self, index: int, num_tokens: int, top_k: int) -> torch.Tensor:
        """Recorded ids `[N, k]` (int64, -1 rows = none) of MoE layer `index` for a forward of `num_tokens`: the
        whole pack's, or this cp rank's chunks' when the block runs inside a context-parallel layer."""
        if self.routes.shape[2] == top_k and self.routes.shape[0] == num_tokens:
            return self.routes[:, index].long()
        if self.routes.shape[2] == top_k and self.local_index is not None and self.local_index.numel() == num_tokens:
            return self.routes[:, index].index_select(0, self.local_index).long()
        local = "" if self.local_index is None else f" (this context-parallel rank's chunks: {self.local_index.numel()})"
        raise RoutingReplayError(
            f"routing replay: MoE layer {index} runs {num_tokens} tokens with top-k {top_k}, the recorded routes "
            f"are {tuple(self.routes.shape)} [tokens, layers, k]{local} (the forward's token layout must be the packed one)")

    @torch.no_grad()
    def count(self, natural: torch.Tensor, recorded: torch.Tensor) -> None:
        """Add the recorded (token, layer) pairs of one block and those whose natural top-k set differs."""
        if torch._C._current_graph_task_id() != -1:  # activation checkpointing's recomputation: counted already
            return
        valid = recorded[:, 0] >= 0
        differ = (natural.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1) & valid
        self._counts += torch.stack([differ.sum(), valid.sum()])

    def mismatch(self) -> tuple[int, int]:
        """(token x layer pairs whose natural top-k set differs from the recorded one, recorded pairs)."""
        d, n = self._counts.tolist()
        return int(d), int(n)


@contextlib.contextmanager
def replaying_routes(model: nn.Module, routes: torch.Tensor, *, force: bool = True) -> Iterator[RoutePlan]:
    """The model's MoE blocks (layer order) read `routes[:, i]` while the block runs (module docstring): native
    `MoE` blocks and megatron-core's MoE layers (models/mcore/moe_layer.py) alike. A MoE layer that takes no
    plan is refused when `force`; without it that layer is not compared."""
    # the blocks of models.common.moe.moe_layers, in the same order (that module imports this one)
    layers = [m for m in model.modules() if getattr(type(m), "accepts_route_plan", False)
              or getattr(type(m), "reports_expert_load", False)]
    native = [m for m in layers if getattr(type(m), "accepts_route_plan", False)]
    if force and len(native) != len(layers):
        raise RoutingReplayError(f"routing replay: MoE layers of type {type(next(m for m in layers if m not in native)).__name__} "
                                 "cannot take recorded routes")
    if routes.shape[1] != len(layers):
        raise RoutingReplayError(f"routing replay: routes for {routes.shape[1]} MoE layers, the model has {len(layers)}")
    check_recorded_ids(routes, [int(getattr(m, "num_experts")) for m in layers])  # noqa: B009 -- duck typed
    plan = RoutePlan(routes, force, _context_parallel_index(model, routes.shape[0]))
    for i, m in enumerate(layers):
        if getattr(type(m), "accepts_route_plan", False):
            setattr(m, "route_plan", (plan, i))  # noqa: B010 -- an attribute of MoE blocks, found by duck typing
    try:
        yield plan
    finally:
        for m in native:
            setattr(m, "route_plan", None)  # noqa: B010


def check_recorded_ids(routes: torch.Tensor, num_experts: list[int]) -> None:
    """Refuse recorded routes `[N, layers, k]` that no router of these layers could have chosen: each row must be
    k distinct experts of its layer (0..E-1) or all -1 (no route). Anything else (a record of another model, a
    corrupted one) would misroute silently (two copies of one expert, -2 read as "no route") or fail deep inside
    the experts with an index error. One host read per forward."""
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise RoutingReplayError(f"routing replay: routes must hold integer expert ids, got {routes.dtype}")
    r = routes.long()
    experts = torch.tensor(num_experts, dtype=torch.long, device=r.device)[None, :, None]
    unrecorded = (r == -1).all(-1)
    ordered = r.sort(-1).values
    chosen = ((r >= 0) & (r < experts)).all(-1) & (ordered[..., 1:] != ordered[..., :-1]).all(-1)
    bad = ~(unrecorded | chosen)
    if bool(bad.any()):
        token, layer = (int(v) for v in bad.nonzero()[0].tolist())
        raise RoutingReplayError(
            f"routing replay: recorded experts {r[token, layer].tolist()} of token {token}, MoE layer {layer} "
            f"({int(bad.sum())} such rows): a record holds {r.shape[2]} distinct experts of the layer's "
            f"{num_experts[layer]} (0..{num_experts[layer] - 1}) or a row of -1 (no route) per token and layer")


def context_parallel_of(model: nn.Module) -> Optional[Any]:
    """The `ContextParallel` of the model's context-parallel layers (`apply_cp` gives it to their attention
    modules), or None: a plan's counts then cover this rank's chunks only (sum them over `.group`)."""
    cpx = next((c for m in model.modules() if (c := getattr(m, "context_parallel", None)) is not None), None)
    return cpx if cpx is not None and cpx.size > 1 else None


def _context_parallel_index(model: nn.Module, total: int) -> Optional[torch.Tensor]:
    """The pack rows this rank's context-parallel layers run, or None without context parallelism."""
    cpx = context_parallel_of(model)
    if cpx is None:
        return None
    from megatron_vlm.parallel.context_parallel import CPPlan  # parallel/ imports models/: not at module level

    return CPPlan.build(total, cpx.size, cpx.rank, "cpu").index
