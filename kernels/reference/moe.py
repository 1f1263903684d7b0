"""Reference MoE token dispatch ops: permute tokens by expert, grouped matmul, unpermute + combine.

Layouts (N tokens, k experts per token, E experts, H hidden):

- `topk_ids` `[N, k]` int: the experts chosen by each token (slot j of token t is pair i = t*k + j).
- `moe_permute(hidden [N, H], topk_ids)` -> `(permuted [N*k, H], row_map [N*k] int32,
  tokens_per_expert [E] int64)`. `permuted` holds one copy of a token per chosen expert, grouped by
  expert in ascending order; inside an expert's group rows keep the order of i (stable sort).
  `row_map[i]` is the row of `permuted` that holds pair i. This is the `sorted_indices` output of
  `torch_npu.npu_moe_token_permute` (argsort of the argsort of `flatten(topk_ids)`), so NPU
  adapters pass it through unchanged.
- `grouped_mm(x [M, K], weight, tokens_per_expert=... | offsets=...)` -> `[M, N]`: rows of expert e
  (a contiguous group) are multiplied by expert e's matrix. `weight` is `[E, K, N]`
  (`weight_layout="ekn"`, y = x @ w[e]) or `[E, N, K]` (`"enk"`, nn.Linear / HF expert layout,
  y = x @ w[e].T). Groups are given as counts (`tokens_per_expert`, `[E]`) or cumulative ends
  (`offsets`, `[E]`, torch._grouped_mm / npu `group_list_type=0` convention). Rows past the last
  group (padding) come out as zeros.
- `moe_unpermute(permuted_out [N*k, H], row_map, topk_weights [N, k])` -> `[N, H]`:
  out[t] = sum_j topk_weights[t, j] * permuted_out[row_map[t*k + j]], accumulated in fp32 (fp64 stays fp64).
"""
from __future__ import annotations

from typing import Optional

import torch


def moe_permute_topk_ids(hidden: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The shape / dtype checks of moe_permute (shared by every backend, so the errors are the same);
    returns topk_ids as [N, k] (a [N] vector is top-1)."""
    if hidden.dim() != 2:
        raise ValueError(f"moe_permute: hidden must be [N, H], got {tuple(hidden.shape)}")
    if topk_ids.dim() == 1:
        topk_ids = topk_ids[:, None]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"moe_permute: topk_ids must be [N={hidden.shape[0]}, k], got {tuple(topk_ids.shape)}"
        )
    if topk_ids.is_floating_point():
        raise ValueError(f"moe_permute: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    return topk_ids


def moe_permute_num_experts(topk_ids: torch.Tensor, num_experts: Optional[int]) -> int:
    """`num_experts`, or max id + 1 when it is None; ValueError for an id below 0 or not below num_experts (a host
    sync: every backend checks the values the same way)."""
    if topk_ids.numel() and int(topk_ids.min()) < 0:
        raise ValueError(f"moe_permute: negative expert id {int(topk_ids.min())} in topk_ids")
    if num_experts is None:
        return int(topk_ids.max()) + 1 if topk_ids.numel() else 0
    if topk_ids.numel() and int(topk_ids.max()) >= num_experts:
        raise ValueError(f"moe_permute: expert id {int(topk_ids.max())} >= num_experts {num_experts}")
    return num_experts


def moe_permute(hidden: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: Optional[int] = None):
    """Group token copies by expert (see module docstring). `num_experts` sizes tokens_per_expert
    (default: max id + 1; pass it explicitly so every layer reports all E experts)."""
    topk_ids = moe_permute_topk_ids(hidden, topk_ids)
    topk = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    num_experts = moe_permute_num_experts(flat, num_experts)
    order = torch.argsort(flat, stable=True)  # order[r] = pair i held by permuted row r
    row_map = torch.empty_like(order)
    row_map[order] = torch.arange(order.numel(), device=order.device)
    permuted = hidden.index_select(0, order // topk)
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    return permuted, row_map.to(torch.int32), tokens_per_expert


def _group_ends(tokens_per_expert, offsets, num_groups: int):
    if (tokens_per_expert is None) == (offsets is None):
        raise ValueError("grouped_mm: give exactly one of tokens_per_expert (counts) or offsets (cumulative ends)")
    if tokens_per_expert is not None:
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if any(c < 0 for c in counts):
            raise ValueError(f"grouped_mm: negative count in tokens_per_expert {counts}")
        ends, total = [], 0
        for c in counts:
            total += c
            ends.append(total)
    else:
        ends = [int(o) for o in offsets.tolist()]
        if any(b < a for a, b in zip(ends[:-1], ends[1:])) or (ends and ends[0] < 0):
            raise ValueError(f"grouped_mm: offsets must be non-decreasing and >= 0, got {ends}")
    if len(ends) != num_groups:
        raise ValueError(f"grouped_mm: {len(ends)} groups given for a weight with {num_groups} experts")
    return ends


def grouped_mm_group_ends(x, weight, tokens_per_expert, offsets, weight_layout: str) -> list[int]:
    """Check `grouped_mm`'s arguments (every backend raises the same errors) and return the
    cumulative row end of each expert's group."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"grouped_mm: x must be [M, K] and weight [E, K, N] or [E, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if weight_layout not in ("ekn", "enk"):
        raise ValueError(f"grouped_mm: weight_layout must be 'ekn' or 'enk', got {weight_layout!r}")
    in_dim = weight.shape[1] if weight_layout == "ekn" else weight.shape[2]
    if x.shape[1] != in_dim:
        raise ValueError(
            f"grouped_mm: x has K={x.shape[1]} but weight ({weight_layout}) {tuple(weight.shape)} expects K={in_dim}"
        )
    ends = _group_ends(tokens_per_expert, offsets, weight.shape[0])
    if ends and ends[-1] > x.shape[0]:
        raise ValueError(f"grouped_mm: groups cover {ends[-1]} rows but x has {x.shape[0]}")
    return ends


def moe_unpermute_topk(permuted_out, row_map, topk_weights, topk: Optional[int]) -> int:
    """Check `moe_unpermute`'s arguments (every backend raises the same errors) and return k."""
    if permuted_out.dim() != 2:
        raise ValueError(f"moe_unpermute: permuted_out must be [N*k, H], got {tuple(permuted_out.shape)}")
    if row_map.dim() != 1 or row_map.numel() != permuted_out.shape[0]:
        raise ValueError(
            f"moe_unpermute: row_map must be [{permuted_out.shape[0]}] (one entry per permuted row), "
            f"got {tuple(row_map.shape)}"
        )
    if topk_weights is not None:
        k = topk_weights.shape[-1]
        if topk_weights.dim() != 2 or topk_weights.numel() != row_map.numel():
            raise ValueError(
                f"moe_unpermute: topk_weights must be [N, k] with N*k = {row_map.numel()}, got {tuple(topk_weights.shape)}"
            )
        return k
    k = 1 if topk is None else topk
    if row_map.numel() % k:
        raise ValueError(f"moe_unpermute: {row_map.numel()} rows do not split into groups of topk={k}")
    return k


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tokens_per_expert: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    weight_layout: str = "ekn",
) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups (see module docstring); differentiable."""
    ends = grouped_mm_group_ends(x, weight, tokens_per_expert, offsets, weight_layout)
    out_dim = weight.shape[2] if weight_layout == "ekn" else weight.shape[1]
    outs, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            w = weight[e] if weight_layout == "ekn" else weight[e].t()
            outs.append(x[start:end] @ w)
        start = end
    if not outs and weight.shape[0]:
        # no routed row (an expert-parallel rank whose experts got no token): an empty product keeps x and the
        # weights in the graph, so they get zero gradients (as from the kernels) instead of none on this rank only
        outs.append(x[:0] @ (weight[0] if weight_layout == "ekn" else weight[0].t()))
    tail = x.shape[0] - start
    if tail:
        outs.append(x.new_zeros(tail, out_dim))
    if not outs:
        return x.new_zeros(0, out_dim)
    return torch.cat(outs, dim=0)


def moe_unpermute(
    permuted_out: torch.Tensor,
    row_map: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    *,
    topk: Optional[int] = None,
) -> torch.Tensor:
    """Gather each token's k expert outputs back and combine them with `topk_weights` `[N, k]`
    (plain sum when None; then `topk` gives k, default 1). fp32 accumulation, output in
    permuted_out's dtype."""
    k = moe_unpermute_topk(permuted_out, row_map, topk_weights, topk)
    gathered = permuted_out.index_select(0, row_map.long())
    gathered = gathered.to(torch.promote_types(gathered.dtype, torch.float32))
    gathered = gathered.view(-1, k, permuted_out.shape[1])
    if topk_weights is not None:
        gathered = gathered * topk_weights.to(gathered.dtype)[..., None]
    return gathered.sum(dim=1).to(permuted_out.dtype)
