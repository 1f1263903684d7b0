"""Rollout KV-cache sizing (in `rl`, below `plan`: the GRPO job must not import the planner), shared by the GRPO job (to bound a rollout batch by `rl.rollout.memory_gib`)
and the `--check` planner.

KV cache bytes = 2 (K and V) x sum over the decoder's attention layers of (kv_heads x head_dim) x
bytes per element x slots, where a slot is one cached token position of one sequence. A sequence
of a rollout holds up to `data.max_tokens_per_pack` slots (the prompt encoder refuses prompts whose
prompt + rl.rollout.max_new_tokens exceeds it), and one prompt's group holds `rl.batch.group_size` sequences.
Attention layers are the `Attention` modules under `model.language_model` (hybrid Mamba layers keep
a per-sequence state of constant size, not counted); works on a meta-device model.
"""
from __future__ import annotations

import math

from torch import nn

__all__ = ["kv_elements_per_slot", "kv_bytes_per_slot", "rollout_prompts_for_budget"]


def kv_elements_per_slot(model: nn.Module) -> int:
    """2 x sum over the decoder's attention layers of kv_heads x head_dim (elements per cached token)."""
    decoder = getattr(model, "language_model", model)
    total = 0
    for m in decoder.modules():  # Attention modules, or megatron-core layers (models/mcore/layer.py) answering for theirs
        local_heads = getattr(m, "local_heads", None)
        if callable(local_heads):
            head_dim = getattr(m, "head_dim")  # noqa: B009 - not declared on nn.Module (mypy reads it as a Tensor / Module)
            total += 2 * local_heads()[1] * int(head_dim)
    return total


def kv_bytes_per_slot(model: nn.Module, bytes_per_element: int) -> int:
    return kv_elements_per_slot(model) * bytes_per_element


def rollout_prompts_for_budget(budget_gib: float, bytes_per_slot: int, group_size: int, slots_per_sequence: int) -> int:
    """Prompts whose groups' KV cache fits `budget_gib` (at least 1); 0 when there is no budget."""
    if budget_gib <= 0:
        return 0
    per_prompt = bytes_per_slot * group_size * slots_per_sequence
    return max(1, math.floor(budget_gib * 2**30 / per_prompt))
