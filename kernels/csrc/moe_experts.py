"""Routed MoE experts of an inference step in one call of `megatron_vlm._C` (csrc/cpu_moe_experts.cpp).

Why: the module path (`GroupedExperts`: moe_permute -> grouped_mm -> activation -> grouped_mm -> moe_unpermute)
is ~30 ATen calls per layer whose per-expert GEMMs multiply a few rows by the plain weights; at the tiny
Qwen3-MoE decode shape (64 tokens, 8 experts top 2, hidden 256) the C++ op on MKL-packed weights took 0.8 ms
a layer against 1.8 ms (benchmarks/RESULTS.md). Inference only: no autograd (the caller checks).

Contract: `moe_experts(...)` returns what `GroupedExperts.forward` returns — (combined output `[N, hidden]`,
tokens_per_expert `[E]` int64) — to fp32 rounding, for contiguous float32 CPU operands. `pack_expert_weights(w)`
lays out every expert of a `[E, out, in]` weight for MKL once (an empty tensor where this torch has no MKL; the
op then multiplies by the plain weights).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ACTIVATIONS", "available", "pack_expert_weights", "moe_experts"]

ACTIVATIONS = {"silu": 0, "relu2": 1, "gelu": 2, "gelu_pytorch_tanh": 3}
"""Activation names (models/common/moe.py) -> the op's codes."""


_AVAILABLE: Optional[bool] = None


def available() -> bool:
    """Whether the loaded extension has the op (a `_C` built before it existed has not); checked once."""
    global _AVAILABLE
    if _AVAILABLE is None:
        from megatron_vlm._ext import load

        _AVAILABLE = load() is not None and hasattr(torch.ops.megatron_vlm, "moe_experts")
    return _AVAILABLE


def _ops():
    """torch.ops.megatron_vlm, the extension loaded (RuntimeError when it cannot be)."""
    if not available():
        raise RuntimeError("megatron_vlm._C with the moe_experts op is not available")
    return torch.ops.megatron_vlm


def pack_expert_weights(w: torch.Tensor) -> torch.Tensor:
    """MKL-packed copies of the E matrices of `w` `[E, out, in]` (uint8 `[E, bytes]`; empty without MKL)."""
    return _ops().moe_pack_expert_weights(w.detach().contiguous())


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    gated: bool,
    activation: str,
    w1_packed: Optional[torch.Tensor] = None,
    w2_packed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[N, hidden]`, topk_ids / topk_weights `[N, k]`, w1 the `gate_up_proj` ([gate; up], gated) or `up_proj`
    `[E, out, hidden]`, w2 the `down_proj` `[E, hidden, inter]` -> (out `[N, hidden]`, tokens_per_expert `[E]`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {activation!r} not in {sorted(ACTIVATIONS)}")
    return _ops().moe_experts(
        x.contiguous(), topk_ids.long().contiguous(), topk_weights.float().contiguous(), w1.detach().contiguous(),
        w2.detach().contiguous(), w1_packed, w2_packed, bool(gated), ACTIVATIONS[activation])
