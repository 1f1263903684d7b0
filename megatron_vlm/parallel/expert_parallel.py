"""Expert parallelism (EP): each rank of an EP group holds E / ep of a MoE block's routed experts and
the tokens travel to the rank that holds their expert and back, with two all-to-alls.

Why: the routed experts are most of a MoE model's weights (Nemotron-3-Nano-30B-A3B: 128 experts per
layer) but each token uses only k of them. Sharding the experts instead of gathering them (FSDP)
keeps the expert weights resident and sends activations, which are much smaller per step.

Design (one MoE block, EP group of size ep, rank r holds the contiguous experts
[r * E/ep, (r+1) * E/ep) — the `Shard(0)` layout of the stacked `[E, out, in]` weights):

1. The router, the shared experts and the load counts are untouched: every rank routes its own
   tokens over all E experts, and `tokens_per_expert` `[E]` (which feeds the load-balancing counts
   and the auxiliary loss) still counts this rank's tokens' choices of every expert.
2. `kernels.moe_permute` groups this rank's token copies by global expert id; because experts are
   contiguous per rank, the rows bound for rank d are one contiguous slice.
3. The per-(destination rank, local expert) counts are exchanged first (an all-to-all of E integers),
   so every rank knows its variable split sizes; then the token rows are exchanged
   (`all_to_all_single` with those splits). Received rows come ordered (source rank, local expert);
   an index permutation regroups them (local expert, source rank) for `kernels.grouped_mm`.
4. The local experts run with the same kernels ops as the unsharded block (weights cast to the
   activation dtype, since expert weights are not FSDP parameters and get no mixed-precision cast).
5. The outputs are put back in (source rank, local expert) order, returned with the reverse
   all-to-all and combined with the routing weights by `kernels.moe_unpermute` — exactly as the
   unsharded block does, so a token's result does not depend on where its experts live.

Backend: steps 2-5 are the kernels op `moe_ep_dispatch` (`[kernels] moe_ep_dispatch`): `torch` is
`all_to_all_forward` below, `deep_ep` sends each token once per destination rank with DeepEP's
dispatch / combine (kernels/thirdparty/deep_ep.py; auto on CUDA for bf16 when deep_ep imports).

Autograd: `_AllToAll` is a custom Function whose backward is the all-to-all with the splits swapped,
so the gradient of a token row goes back to the rank that sent it and the local expert weights'
gradient is the full gradient from every EP rank's tokens. A rank that receives no rows still keeps
the received rows and its expert weights in the graph (with a zero contribution), so every rank runs
the same backward collectives and has a (zero) gradient.

Placement: with a `ProcessGroup`, the expert weights become plain local slices (the unit tests'
form). With a `DeviceMesh` whose last dim is the EP dim, they become DTensors placed `Shard(0)` on
it (and `Replicate()` on a leading replica dim if the mesh is 2-D), so DCP checkpoints and
`full_tensor()` / full-state-dict exports see the whole `[E, out, in]` tensors. Such parameters
must not also be FSDP parameters (`expert_parameters` lists them for `ignored_params`). Their
gradient is summed over the replica dim (ranks holding the same experts but reading other data) and
divided by `grad_divide_factor`, matching FSDP's average over the data-parallel ranks.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_vlm import kernels
from megatron_vlm.kernels.static_experts import static_mlp

_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `input_splits` go to the ranks of `group`; returns the rows received
    (`output_splits` from each rank, in rank order). Backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _ReduceGradOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (replicas of the same expert shard)
    and divides by `divide_factor`."""

    @staticmethod
    def forward(ctx, w, group, divide_factor: float):
        ctx.group, ctx.divide_factor = group, divide_factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        if ctx.divide_factor != 1.0:
            grad = grad / ctx.divide_factor
        return grad, None, None


def _regroup_index(recv_counts: torch.Tensor) -> torch.Tensor:
    """recv_counts `[ep, El]` (rows from source s for local expert e, received in (s, e) order) ->
    index into the received rows that orders them (e, s)."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)
    counts_es, starts_es = recv_counts.t().reshape(-1), starts.t().reshape(-1)
    total = int(flat.sum())
    group_begin = torch.cumsum(counts_es, 0) - counts_es  # where each (e, s) chunk begins in the target order
    offset_in_chunk = torch.arange(total, device=flat.device) - torch.repeat_interleave(group_begin, counts_es)
    return torch.repeat_interleave(starts_es, counts_es) + offset_in_chunk


class ExpertParallelExperts(nn.Module):
    """Mixin over an experts module that holds only this rank's experts; the forward dispatches with
    all-to-all. `apply_ep` swaps an experts module's class to `ExpertParallel<Class>(ExpertParallelExperts,
    <Class>)` (as FSDP2 does), so parameter names and checkpoints keep their keys and this package needs
    no model class.

    The experts module it wraps provides (`models.common.moe.GroupedExperts` does): `num_experts`,
    `gated`, stacked weights `[E, out, in]` named `gate_up_proj` (gated) or `up_proj`, and `down_proj`,
    and `expert_mlp(rows, tokens_per_expert, first, down)`, the per-expert MLP on rows grouped by
    expert with the given weights."""

    ep_group: object
    ep_size: int
    ep_rank: int
    num_local_experts: int
    replica_group: object
    grad_divide_factor: float

    def _local_weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        w = getattr(self, name)
        if hasattr(w, "to_local"):
            w = w.to_local()
        if self.replica_group is not None or self.grad_divide_factor != 1.0:
            w = _ReduceGradOverReplicas.apply(w, self.replica_group, self.grad_divide_factor)
        return w.to(dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x `[N, hidden]` -> (combined output `[N, hidden]`, tokens_per_expert `[E]` of this rank's tokens),
        by the `moe_ep_dispatch` kernels backend: `torch` (`all_to_all_forward`) or `deep_ep`."""
        return kernels.DEFAULT_REGISTRY.resolve("moe_ep_dispatch", x)(self, x, topk_ids, topk_weights)

    def static_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, form: str = "auto"):
        """The graph-safe form for static decode steps (models/common/moe_static.py; inference only): no host read,
        shapes fixed by N. The all-to-all needs its split sizes on the host, so instead every rank's tokens and
        routes are all-gathered (one collective, packed as bytes) (every rank of the group must step the same N rows: the rollout engine's lock-step
        static steps take one batch size), each rank runs its own experts on the copies routed to them, and the
        partial outputs are summed back to their tokens' ranks with a reduce-scatter. Decode steps move a few
        hundred KB per layer this way (N x hidden per rank); the prefill keeps the all-to-all. Returns `[N, hidden]`
        fp32, equal to `forward`'s output up to the order of fp32 additions."""
        ep, group = self.ep_size, self.ep_group
        n = x.shape[0]
        # one all-gather of the rows, expert ids and routing weights as bytes side by side (decode collectives are
        # latency-bound: one per layer instead of three)
        parts = [t.contiguous().view(torch.uint8) for t in (x, topk_ids, topk_weights)]
        widths = [p.shape[1] for p in parts]
        packed = torch.cat(parts, dim=1)
        gathered = packed.new_empty(ep * n, packed.shape[1])
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, packed, group=group)
        xs, ids, weights = (chunk.contiguous().view(t.dtype) for chunk, t in
                            zip(gathered.split(widths, dim=1), (x, topk_ids, topk_weights)))
        local = ids - self.ep_rank * self.num_local_experts
        valid = (local >= 0) & (local < self.num_local_experts)
        first = self._local_weight("gate_up_proj" if self.gated else "up_proj", x.dtype)
        down = self._local_weight("down_proj", x.dtype)
        partial = static_mlp(xs, torch.where(valid, local, 0), weights, first, down, gated=bool(self.gated), act=self.act,
                             form=form, valid=valid)
        out = partial.new_empty(n, partial.shape[1])
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, partial, group=group)
        return out


def all_to_all_forward(experts: ExpertParallelExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """The `torch` backend of `moe_ep_dispatch`: steps 2-5 of the module docstring with two
    `all_to_all_single`s over the (token, expert) copies. Returns (combined `[N, hidden]`, tokens_per_expert `[E]`)."""
    ep, n_local = experts.ep_size, experts.num_local_experts
    permuted, row_map, tokens_per_expert = kernels.moe_permute(x, topk_ids, num_experts=experts.num_experts)
    send_counts = tokens_per_expert.view(ep, n_local).contiguous()  # [destination rank, local expert]
    recv_counts = torch.empty_like(send_counts)  # [source rank, local expert]
    dist.all_to_all_single(recv_counts, send_counts, group=experts.ep_group)
    input_splits = send_counts.sum(1).tolist()
    output_splits = recv_counts.sum(1).tolist()
    received = _AllToAll.apply(permuted, output_splits, input_splits, experts.ep_group)

    order = _regroup_index(recv_counts)
    local_in = received.index_select(0, order)
    local_counts = recv_counts.sum(0)
    first = experts._local_weight("gate_up_proj" if experts.gated else "up_proj", x.dtype)
    down = experts._local_weight("down_proj", x.dtype)
    local_out = experts.expert_mlp(local_in, local_counts, first, down)
    if local_out.shape[0] == 0:
        # No rows here: grouped_mm's empty output is cut off from its inputs, so tie it to the
        # received rows and the weights (zero contribution). Otherwise this rank would skip the
        # backward all-to-all the senders run, and the replica all-reduce of the weight gradients.
        local_out = local_out + 0.0 * (received.sum() + first.sum() + down.sum())

    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    by_source = local_out.index_select(0, inverse)
    returned = _AllToAll.apply(by_source, input_splits, output_splits, experts.ep_group)
    return kernels.moe_unpermute(returned, row_map, topk_weights), tokens_per_expert


_EP_CLASSES: dict = {}


def _expert_parallel_class(cls: type) -> type:
    """`ExpertParallel<cls>`: the EP forward over `cls` (one class per wrapped class)."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _EP_CLASSES[cls]


def _resolve(ep_group_or_mesh):
    """-> (ep_group, ep_size, ep_rank, mesh or None, replica_group or None)."""
    if isinstance(ep_group_or_mesh, DeviceMesh):
        mesh = ep_group_or_mesh
        if mesh.ndim not in (1, 2):
            raise ValueError(f"apply_ep: the mesh must be 1-D (ep) or 2-D (replica, ep), got {mesh.ndim} dims")
        group = mesh.get_group(mesh.ndim - 1)
        replica = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
        return group, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1), mesh, replica
    if ep_group_or_mesh is None:
        raise ValueError("apply_ep: give the EP ProcessGroup or DeviceMesh, got None")
    group = ep_group_or_mesh
    return group, dist.get_world_size(group), dist.get_rank(group), None, None


def apply_ep(moe_modules: Iterable[nn.Module], ep_group_or_mesh, *, grad_divide_factor: float = 1.0) -> None:
    """Shard the routed experts of each MoE block over the EP group, in place (see module docstring).

    `moe_modules`: MoE blocks (with `.experts`, see `ExpertParallelExperts`) whose experts hold the full
    `[E, ...]` weights. `ep_group_or_mesh`: a ProcessGroup (local slices as plain parameters) or a
    DeviceMesh, 1-D ep or 2-D (replica, ep) (DTensor parameters, `Shard(0)` on ep).
    `grad_divide_factor`: the expert gradients are divided by it (the trainer's data-parallel size,
    because the loss is scaled by it for FSDP's gradient average).
    """
    group, ep, rank, mesh, replica = _resolve(ep_group_or_mesh)
    if grad_divide_factor <= 0:
        raise ValueError(f"apply_ep: grad_divide_factor must be > 0, got {grad_divide_factor}")
    for i, moe in enumerate(moe_modules):
        experts = getattr(moe, "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            raise ValueError(f"apply_ep: MoE block #{i} already has expert parallelism applied")
        if not (isinstance(experts, nn.Module) and hasattr(experts, "expert_mlp") and hasattr(experts, "down_proj")):
            raise TypeError(f"apply_ep: MoE block #{i} ({type(moe).__name__}) has no grouped `.experts` "
                            "(stacked expert weights and `expert_mlp`, see ExpertParallelExperts)")
        num_experts = experts.num_experts
        if num_experts % ep:
            raise ValueError(
                f"apply_ep: MoE block #{i} has {num_experts} experts, not divisible by the expert-parallel "
                f"size {ep} (parallel.ep); each rank must hold the same number of experts"
            )
        n_local = num_experts // ep
        for name in _EXPERT_WEIGHTS:
            w = getattr(experts, name, None)
            if w is None:
                continue
            if w.shape[0] != num_experts:
                raise ValueError(f"apply_ep: MoE block #{i} {name} has {w.shape[0]} experts, expected {num_experts}")
            local = w.detach()[rank * n_local:(rank + 1) * n_local].clone()
            if mesh is not None:
                placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
                local = DTensor.from_local(local, mesh, placements, run_check=False,
                                           shape=w.shape, stride=w.stride())
            setattr(experts, name, nn.Parameter(local, requires_grad=w.requires_grad))
        experts.__class__ = _expert_parallel_class(type(experts))
        experts.ep_group, experts.ep_size, experts.ep_rank = group, ep, rank
        experts.num_local_experts = n_local
        experts.replica_group = replica
        experts.grad_divide_factor = float(grad_divide_factor)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters sharded by `apply_ep` (to exclude from FSDP and to clip once)."""
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            out += [getattr(m, n) for n in _EXPERT_WEIGHTS if getattr(m, n, None) is not None]
    return out


__all__ = ["all_to_all_forward", "apply_ep", "expert_parameters", "ExpertParallelExperts"]
