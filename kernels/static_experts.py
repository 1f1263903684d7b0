"""Routed experts without host reads (the static decode step's form): shapes fixed by the batch, no count read.

The computations of `megatron_vlm.models.common.moe_static` (why, and the two forms, are described there), kept
here, below both the model and the parallel packages, because the expert-parallel block
(parallel/expert_parallel.py, `static_forward`) runs them on its own slice of the experts.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["grouped_static", "dense_static", "static_mlp"]


def _grouped_mm_takes(x: torch.Tensor, weights: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> bool:
    """Whether torch._grouped_mm takes the operands: x's dtype / device, the weights' strides and pointers, the
    row widths of the activations it will get (16-byte multiples). Metadata only: no tensor value is read."""
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != x.dtype for w in weights):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    strides = [s for w in weights for s in w.stride() if s != 1] + list(widths)
    return all(s * size % 16 == 0 for s in strides) and all(w.data_ptr() % 16 == 0 for w in weights)


def _mlp(first_out: torch.Tensor, gated: bool, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if gated:
        gate, up = first_out.chunk(2, dim=-1)
        return act(gate) * up
    return act(first_out)


def grouped_static(x, topk_ids, topk_weights, first, down, *, gated: bool, act, valid=None) -> torch.Tensor:
    """x `[N, in]`, topk `[N, k]`, weights `[E, out, in]` -> `[N, in]` fp32, via torch._grouped_mm on device offsets.
    `valid` `[N, k]` (optional): the copies to compute; the others are sorted past the last group (their rows of
    the GEMM outputs are not computed) and contribute nothing."""
    n, k = topk_ids.shape
    e = first.shape[0]
    flat = topk_ids.reshape(-1)
    ok = valid.reshape(-1) if valid is not None else None
    order = torch.argsort(flat if ok is None else torch.where(ok, flat, e), stable=True)
    token_of = torch.div(order, k, rounding_mode="floor")
    rows = x.index_select(0, token_of)
    ones = torch.ones_like(flat, dtype=torch.int32) if ok is None else ok.to(torch.int32)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(0, flat.to(torch.int64), ones)
    offs = counts.cumsum(0, dtype=torch.int32)
    mid = _mlp(torch._grouped_mm(rows, first.transpose(1, 2), offs=offs), gated, act)
    out_rows = torch._grouped_mm(mid, down.transpose(1, 2), offs=offs)
    contrib = out_rows.float() * topk_weights.reshape(-1).index_select(0, order).float()[:, None]
    if ok is not None:  # where, not a product: rows past the last group are not computed (any value)
        contrib = torch.where(ok.index_select(0, order)[:, None], contrib, contrib.new_zeros(()))
    return torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token_of, contrib)


def dense_static(x, topk_ids, topk_weights, first, down, *, gated: bool, act, valid=None) -> torch.Tensor:
    """The same result with every token through every expert (batched matmuls), unchosen experts masked out
    (and the copies `valid` says are not computed here)."""
    n = x.shape[0]
    e = first.shape[0]
    xe = x.unsqueeze(0).expand(e, n, x.shape[1])
    mid = _mlp(torch.bmm(xe, first.transpose(1, 2)), gated, act)
    out = torch.bmm(mid, down.transpose(1, 2)).float()  # [E, N, in]
    # scatter_add: the copies `valid` rules out point at expert 0 too (weight 0), so indices may repeat in a row
    w = topk_weights.float() if valid is None else torch.where(valid, topk_weights.float(), 0.0)
    weight = torch.zeros(n, e, dtype=torch.float32, device=x.device).scatter_add_(1, topk_ids, w)
    hits = torch.ones_like(topk_ids, dtype=torch.int32) if valid is None else valid.to(torch.int32)
    chosen = torch.zeros(n, e, dtype=torch.int32, device=x.device).scatter_add_(1, topk_ids, hits) > 0
    # where, not a product with a zero weight: an unchosen expert's output may be inf in low precision
    contrib = torch.where(chosen.t()[..., None], out * weight.t()[..., None], out.new_zeros(()))
    return contrib.sum(0)


def static_mlp(x, topk_ids, topk_weights, first, down, *, gated: bool, act, form: str = "auto", valid=None) -> torch.Tensor:
    """The static experts on explicit weights `[E, out, in]` (`experts_static`'s body; `valid` as in `grouped_static`)."""
    if form == "auto":
        ok = _grouped_mm_takes(x, (first, down), (first.shape[2], down.shape[2]))
        form = "grouped" if ok else "dense"
    fn = grouped_static if form == "grouped" else dense_static
    return fn(x, topk_ids, topk_weights, first, down, gated=gated, act=act, valid=valid)
