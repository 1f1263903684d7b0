"""Ascend NPU adapters for the MoE dispatch ops, on torch_npu's fused kernels.

Our layouts (kernels/reference/moe.py) were chosen to be torch_npu's, so the adapters are thin:

- `moe_permute` -> `torch_npu.npu_moe_token_permute(tokens, indices)`: its `sorted_indices`
  output is argsort(argsort(flatten(indices))) = our `row_map`; tokens_per_expert is a bincount.
- `grouped_mm` -> `torch_npu.npu_grouped_matmul([x], [w_0 .. w_{E-1}], group_list=...,
  group_list_type=1 (counts) or 0 (cumulative ends), group_type=0 (groups split the M axis),
  split_item=2 (one output tensor))`; each w_e is `[K, N]`, so an `"enk"` weight is transposed.
  npu_grouped_matmul has no derivative (torch_npu registers none: torch's fallback would warn at backward and
  leave x and the expert weights without gradient), so `_GroupedMM` supplies it: dx = the same grouped matmul
  of dOut with each w_e^T (rows past the last group: zero, the device op does not write them), dW_e =
  x_e^T dOut_e over each expert's rows (plain matmuls over the host-side group ends).
- `moe_unpermute` -> `torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)`:
  out[i] = sum_j probs[i, j] * permuted[sorted_indices[i*k + j]].

torch_npu is imported lazily, so this module imports on machines without it.
"""
from __future__ import annotations

from typing import Optional

import torch


def _torch_npu():
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the emulator
        raise RuntimeError("npu backend for the MoE ops needs torch_npu, which is not installed") from exc
    return torch_npu


def moe_permute(hidden: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: Optional[int] = None):
    """See kernels.reference.moe.moe_permute."""
    torch_npu = _torch_npu()
    if topk_ids.dim() == 1:
        topk_ids = topk_ids[:, None]
    flat = topk_ids.reshape(-1).long()
    if num_experts is None:
        num_experts = int(flat.max()) + 1 if flat.numel() else 0
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(hidden, topk_ids.long())
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    return permuted, sorted_indices.to(torch.int32), tokens_per_expert


def _device_grouped_mm(torch_npu, x, weights, group_list, group_list_type) -> torch.Tensor:
    (out,) = torch_npu.npu_grouped_matmul(
        [x], weights, group_list=group_list, split_item=2, group_type=0, group_list_type=group_list_type
    )
    return out


class _GroupedMM(torch.autograd.Function):
    """npu_grouped_matmul forward with the backward torch_npu does not register (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, group_list, group_list_type, weight_layout):
        torch_npu = _torch_npu()
        ctx.save_for_backward(x, weight, group_list)
        ctx.group_list_type, ctx.weight_layout = group_list_type, weight_layout
        weights = [w if weight_layout == "ekn" else w.t() for w in weight.unbind(0)]
        return _device_grouped_mm(torch_npu, x, weights, group_list, group_list_type)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, group_list = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        ends = group_list.cumsum(0) if ctx.group_list_type == 1 else group_list
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            weights_t = [w.t() if ctx.weight_layout == "ekn" else w for w in weight.unbind(0)]  # [N, K] each
            grad_x = _device_grouped_mm(_torch_npu(), grad_out, weights_t, group_list, ctx.group_list_type)
            routed = torch.arange(x.shape[0], device=x.device) < (ends[-1] if ends.numel() else 0)
            grad_x = torch.where(routed[:, None], grad_x, torch.zeros((), dtype=grad_x.dtype, device=grad_x.device))
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)
            start = 0
            for e, end in enumerate(ends.tolist()):
                if end > start:
                    g = x[start:end].t() @ grad_out[start:end]  # [K, N]
                    grad_w[e] = g if ctx.weight_layout == "ekn" else g.t()
                start = end
        return grad_x, grad_w, None, None, None


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tokens_per_expert: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    weight_layout: str = "ekn",
) -> torch.Tensor:
    """See kernels.reference.moe.grouped_mm."""
    if (tokens_per_expert is None) == (offsets is None):
        raise ValueError("grouped_mm: give exactly one of tokens_per_expert (counts) or offsets (cumulative ends)")
    if weight_layout not in ("ekn", "enk"):
        raise ValueError(f"grouped_mm: weight_layout must be 'ekn' or 'enk', got {weight_layout!r}")
    _torch_npu()  # the clear error without torch_npu, before autograd wraps the call
    if tokens_per_expert is not None:
        group_list, group_list_type = tokens_per_expert.to(torch.int64), 1
    else:
        group_list, group_list_type = offsets.to(torch.int64), 0
    return _GroupedMM.apply(x, weight, group_list, group_list_type, weight_layout)


def moe_unpermute(
    permuted_out: torch.Tensor,
    row_map: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    *,
    topk: Optional[int] = None,
) -> torch.Tensor:
    """See kernels.reference.moe.moe_unpermute (torch_npu has no `topk` without probs: only k=1)."""
    torch_npu = _torch_npu()
    if topk_weights is None and topk not in (None, 1):
        raise ValueError(f"moe_unpermute (npu): without topk_weights only topk=1 is supported, got topk={topk}")
    probs = None if topk_weights is None else topk_weights.to(permuted_out.dtype)
    return torch_npu.npu_moe_token_unpermute(permuted_out, row_map.to(torch.int32), probs=probs)
