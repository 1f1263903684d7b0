"""Context parallelism (`parallel.cp`): the decoder layers of one packed sequence split over `cp` ranks.

Why: a 16k-token GRPO rollout or SFT pack does not fit one device's attention and MLP activations;
splitting the tokens of every decoder layer over the cp group divides them (and the layers' compute)
by cp, while the ranks of a cp group read the same packs (they are one data-parallel rank).

Layout (load-balanced for the causal mask): a pack of T tokens is cut into 2 x cp chunks at
`T * i // (2 cp)`; rank r holds chunks r and 2cp-1-r, so every rank has one early (cheap) and one late
(expensive) chunk of the causal triangle. Any T works (chunks differ by at most one token; a rank may
hold none of a very short pack); `--check` asks for `data.max_tokens_per_pack` divisible by 2 x cp.

What runs where:

* each context-parallel decoder layer (`apply_cp` adds forward hooks, so parameter names do not
  change) takes the full-length hidden states, keeps its rank's tokens (and their rotary cos / sin:
  M-RoPE / 1-D positions are computed on the whole pack first, so every chunk keeps its true
  positions), runs the layer on them, and all-gathers its output back to the whole pack;
* attention inside such a layer all-gathers the keys / values of the group and attends its local
  queries to them (`ContextParallel.attention`): per chunk [a, b) and per packed sample [s0, s1) that
  meets it, queries [max(a, s0), min(b, s1)) see keys [s0, min(b, s1)) — with the kernels'
  bottom-right causal alignment that is exactly the causal mask of the whole sample (all-gather-KV
  attention, as Llama-3's context parallelism; one varlen kernel call per layer);
* everything between layers (embeddings, vision tower, DeepStack additions, Mamba2 layers, final
  norm, LM head, loss) runs on the whole pack, identically on the ranks of a cp group. Mamba2 layers
  are not split: their recurrent state would have to pass from chunk to chunk; they run the whole
  sequence on every cp rank (correct, not faster). Loss and log-prob reductions therefore need no
  change: every cp rank computes the token mean over the whole sequence.

GRPO: the ranks of a cp group share their data-parallel coordinate, hence their prompts and sampling
seed (`rl.grpo_step` deals prompts by dp rank), and each runs the rollout whole and unsharded (decoding
passes no `cu_seqlens`, so the layers run unwrapped): they generate the same samples. Splitting the
prompts over the cp group instead would need the group to exchange samples before training and would
not shrink a 16k-token rollout's KV cache (each sequence still lives on one rank); the memory that does
not fit at 16k tokens is the training forward's activations, which cp divides. The packed training
forwards (policy, recomputed old log-probs, a LoRA base reference) run context-parallel like SFT's; the
token log-probs are computed from the whole final hidden states on every cp rank (`rl.logprobs`,
chunked: the `[N, V]` logits never exist), so the GRPO loss needs no change. The separate reference
model (`rl.loss.kl_coef` > 0 without LoRA) is an unsharded copy and runs the whole pack.

Gradients: FSDP shards and averages over dp x cp ranks (the "dp_shard_cp" mesh dim). Parameters outside
the context-parallel layers get the same full gradient on every cp rank (their average is it); a
layer's parameters see only the local tokens' contribution, so inside the layers the gradient is
carried scaled by cp (the output all-gather's backward multiplies by cp, the input slice's backward
all-gathers and divides by cp): the cp average of cp x (local part) is the sum over chunks, the
whole-sequence gradient. Keys / values: the all-gather's backward sums every rank's contribution.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.host_copies import on_host

__all__ = ["ContextParallel", "CPPlan", "apply_cp", "cp_chunk_bounds"]


def cp_chunk_bounds(total: int, cp: int) -> list[int]:
    """The 2 x cp + 1 chunk boundaries of a pack of `total` tokens."""
    n = 2 * cp
    return [total * i // n for i in range(n + 1)]


@dataclass
class CPPlan:
    """Which tokens of a pack of `total` tokens each rank of the cp group holds."""

    total: int
    ranges: list[list[tuple[int, int]]]  # per rank: its two chunks [a, b)
    index: torch.Tensor  # this rank's global token indices (int64, ascending within each chunk)
    order: torch.Tensor  # global index of row i of the rank-major concatenation of all ranks' tokens
    sizes: list[int]  # tokens per rank

    @classmethod
    def build(cls, total: int, cp: int, rank: int, device) -> CPPlan:
        b = cp_chunk_bounds(total, cp)
        ranges = [[(b[r], b[r + 1]), (b[2 * cp - 1 - r], b[2 * cp - r])] for r in range(cp)]
        per_rank = [torch.cat([torch.arange(a, e, dtype=torch.long) for a, e in rr]) for rr in ranges]
        order = torch.cat(per_rank)
        return cls(total, ranges, per_rank[rank].to(device, non_blocking=True), order.to(device, non_blocking=True),
                   [int(p.numel()) for p in per_rank])


class _Gather(torch.autograd.Function):
    """Local rows [L_r, ...] -> the whole pack [T, ...] in global order. backward: `reduce` = sum the
    gradients of all ranks then keep the local rows (keys / values: every rank's queries read them);
    otherwise keep the local rows times `scale` (the output of a layer: every rank holds the same
    downstream computation)."""

    @staticmethod
    def forward(ctx, local, cpx: ContextParallel, plan: CPPlan, reduce: bool, scale: float):
        ctx.cpx, ctx.plan, ctx.reduce, ctx.scale = cpx, plan, reduce, scale
        return cpx._all_gather(local, plan)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.cpx.group)
        out = grad.index_select(0, ctx.plan.index)
        if ctx.scale != 1.0:
            out = out * ctx.scale
        return out, None, None, None, None


class _Slice(torch.autograd.Function):
    """The whole pack [T, ...] -> this rank's rows; backward all-gathers the local gradients (divided by cp,
    see the module docstring)."""

    @staticmethod
    def forward(ctx, full, cpx: ContextParallel, plan: CPPlan):
        ctx.cpx, ctx.plan = cpx, plan
        return full.index_select(0, plan.index)

    @staticmethod
    def backward(ctx, grad):
        return ctx.cpx._all_gather(grad.contiguous(), ctx.plan) / ctx.cpx.size, None, None


class ContextParallel:
    """The cp process group and the three operations of a context-parallel layer: `shard` (keep the local
    tokens), `unshard` (all-gather a layer's output) and `attention` (local queries, all keys)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def plan(self, cu_seqlens: torch.Tensor) -> CPPlan:
        # the pack's bounds from their host copy (megatron_vlm/host_copies.py): no device sync in every layer
        return CPPlan.build(int(on_host(cu_seqlens)[-1]), self.size, self.rank, cu_seqlens.device)

    def _all_gather(self, local: torch.Tensor, plan: CPPlan) -> torch.Tensor:
        longest = max(plan.sizes)
        pad = longest - local.shape[0]
        padded = torch.cat([local, local.new_zeros((pad, *local.shape[1:]))]) if pad else local.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        rank_major = torch.cat([p[:n] for p, n in zip(parts, plan.sizes)])
        full = torch.empty_like(rank_major)
        full[plan.order] = rank_major
        return full

    # --- along dim `dim` (the token dim: 0 for packed [T, H], 1 for [1, T, H]) ---
    def shard(self, x: torch.Tensor, plan: CPPlan, dim: int = 0) -> torch.Tensor:
        return _Slice.apply(x.movedim(dim, 0), self, plan).movedim(0, dim)

    def unshard(self, x: torch.Tensor, plan: CPPlan, dim: int = 0) -> torch.Tensor:
        return _Gather.apply(x.movedim(dim, 0), self, plan, False, float(self.size)).movedim(0, dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                  causal: bool, softmax_scale: Optional[float] = None) -> torch.Tensor:
        """q / k / v: this rank's tokens [L, H, D] of the pack `cu_seqlens` (global); returns [L, Hq, D]."""
        plan = self.plan(cu_seqlens)
        k_all = _Gather.apply(k, self, plan, True, 1.0)
        v_all = _Gather.apply(v, self, plan, True, 1.0)
        cu = on_host(cu_seqlens).tolist()
        cq, ck, k_index = [0], [0], []
        for a, b in plan.ranges[self.rank]:
            for s0, s1 in zip(cu[:-1], cu[1:]):
                lo, hi = max(a, s0), min(b, s1)
                if lo >= hi:
                    continue
                k_end = hi if causal else s1
                cq.append(cq[-1] + hi - lo)
                ck.append(ck[-1] + k_end - s0)
                k_index.append(torch.arange(s0, k_end, dtype=torch.long))
        if not k_index:  # this rank holds no token of the pack
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]) + 0.0 * (k_all.sum() + v_all.sum())
        idx = torch.cat(k_index).to(q.device, non_blocking=True)  # made on the host, moved without waiting
        lens_q = [e - s for s, e in zip(cq[:-1], cq[1:])]
        lens_k = [e - s for s, e in zip(ck[:-1], ck[1:])]
        cu_q = torch.tensor(cq, dtype=torch.int32).to(q.device, non_blocking=True)
        cu_k = torch.tensor(ck, dtype=torch.int32).to(q.device, non_blocking=True)
        return kernels.attention(q, k_all.index_select(0, idx), v_all.index_select(0, idx), causal=causal,
                                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                 max_seqlen_k=max(lens_k), softmax_scale=softmax_scale)


def apply_cp(layers: Iterable[nn.Module], cpx: ContextParallel) -> int:
    """Make `layers` (decoder layers without a recurrent mixer: the caller leaves Mamba2 layers out)
    context-parallel for packed input (`cu_seqlens` given; decoding and padded batches run unchanged):
    their attention modules (those with a `context_parallel` attribute) get `cpx`. Returns how many
    layers it wrapped.

    The split is a pair of forward hooks, the entry one prepended and the exit one appended, so that it
    encloses every other hook of the layer: with tensor parallelism (`apply_tp` hooks: the sequence
    parallel shard of the layer's input) the cp rank keeps its chunks of the pack first and the tp ranks
    then split those chunks; on the way out tp gathers its shard, then cp its chunks. Parameter names do
    not change (no wrapper module)."""
    wrapped = 0
    for layer in layers:
        if getattr(layer, "_mvlm_cp", False):
            continue
        for m in layer.modules():
            if hasattr(m, "context_parallel"):
                m.context_parallel = cpx
        plans: list = []  # this layer's plans of the calls in progress (None: a call without cu_seqlens)

        def enter(module, args, kwargs, _plans=plans):
            cu = kwargs.get("cu_seqlens")
            if cu is None:
                _plans.append(None)
                return None
            plan = cpx.plan(cu)
            _plans.append(plan)
            x = args[0]
            rest = [a.index_select(0, plan.index) if torch.is_tensor(a) and a.dim() >= 1 and a.shape[0] == plan.total
                    else a for a in args[1:]]  # per-token rotary cos / sin [T, D]
            return (cpx.shard(x, plan, x.dim() - 2), *rest), kwargs  # the token dim: [T, H] or [1, T, H]

        def leave(module, args, kwargs, out, _plans=plans):
            plan = _plans.pop()
            return None if plan is None else cpx.unshard(out, plan, out.dim() - 2)

        layer.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
        layer.register_forward_hook(leave, with_kwargs=True)
        layer._mvlm_cp = True
        wrapped += 1
    return wrapped
