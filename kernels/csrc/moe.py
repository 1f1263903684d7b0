"""moe_permute and moe_topk_gating on the compiled ops of `megatron_vlm._C` (csrc/moe_routing_cpu.cpp, csrc/cuda/).

The `csrc` backends of the kernels registry's MoE routing ops: the same signatures, outputs and errors as the
references (`kernels/reference/moe.py`, `moe_routing.py`). The registry's check (`megatron_vlm._ext.backend_check`)
loads the extension before either is called.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference.moe import moe_permute_num_experts, moe_permute_topk_ids

__all__ = ["moe_permute", "moe_topk_gating"]


def moe_permute(hidden: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: Optional[int] = None):
    """kernels.moe_permute with the indices from counting (csrc/): same outputs and errors as the reference."""
    topk_ids = moe_permute_topk_ids(hidden, topk_ids)
    if not torch.compiler.is_compiling():  # value checks need a host sync, as in the reference
        num_experts = moe_permute_num_experts(topk_ids, num_experts)
    elif num_experts is None:
        raise ValueError("moe_permute: pass num_experts under torch.compile")
    row_map, source, tokens_per_expert = torch.ops.megatron_vlm.moe_permute_indices(topk_ids, num_experts)
    return hidden.index_select(0, source), row_map, tokens_per_expert


def moe_topk_gating(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
):
    """kernels.moe_topk_gating fused in C++ / CUDA: (scores [N, E], topk_weights [N, k], topk_ids [N, k])."""
    if score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_topk_gating: score_func must be sigmoid or softmax, got {score_func!r}")
    return torch.ops.megatron_vlm.topk_gating(
        logits.float(), None if bias is None else bias.float(), int(top_k), score_func == "sigmoid", int(n_group),
        int(topk_group), bool(norm_topk_prob), float(routed_scaling_factor),
    )
