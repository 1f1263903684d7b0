"""Reference MoE router gating: router logits -> (scores, top-k weights, top-k expert ids).

`moe_topk_gating(logits [N, E], top_k, score_func=..., bias=None, n_group=1, topk_group=1,
norm_topk_prob=True, routed_scaling_factor=1.0)` -> `(scores [N, E] fp32, topk_weights [N, k] fp32,
topk_ids [N, k] int64)`, the math of `TopKRouter.forward` (megatron_vlm/models/common/moe.py) after
its logits:

- scores = softmax(logits) (Qwen3-MoE) or sigmoid(logits) (Nemotron-H, DeepSeek-V3);
- choice = scores + bias (the score-correction bias of auxiliary-loss-free balancing; used only
  to pick experts);
- grouped selection (n_group > 1): keep the `topk_group` best of `n_group` contiguous expert groups,
  group score = sum of its two best choice values, other experts masked to -inf;
- topk_ids = the top_k of choice (descending); topk_weights = scores at those ids, divided by
  their sum + 1e-20 when norm_topk_prob, times routed_scaling_factor.

Gradients flow from scores and topk_weights to logits. The compiled `csrc` backend
(megatron_vlm/_ext.py) computes the same in one fused C++ / CUDA op.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


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
    if score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_topk_gating: score_func must be sigmoid or softmax, got {score_func!r}")
    logits = logits.float()
    num_experts = logits.shape[-1]
    # the csrc op's checks (csrc/moe_routing_cpu.cpp): a top-k larger than the kept groups hold would pick
    # experts of dropped groups (their choice is -inf) instead of failing
    if not 0 < top_k <= num_experts:
        raise ValueError(f"moe_topk_gating: top_k {top_k} must be in 1..{num_experts}")
    if not (n_group > 0 and num_experts % n_group == 0 and 0 < topk_group <= n_group):
        raise ValueError(f"moe_topk_gating: n_group {n_group} must divide {num_experts} and topk_group {topk_group} "
                         "be in 1..n_group")
    if n_group > 1 and top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"moe_topk_gating: top_k {top_k} exceeds the {topk_group * (num_experts // n_group)} experts "
                         f"of the {topk_group} kept groups")
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], -math.inf).view(-1, num_experts)
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return scores, topk_weights * routed_scaling_factor, topk_ids
