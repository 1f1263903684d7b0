"""`--check`: the memory and traffic of the MoE routes the rollout engine records (routing replay).

Why a line of its own: with `rl.routing_replay = "rollout"` (and for the routing-mismatch metric of every MoE
policy on the built-in engine) each prompt and generated token carries its top-k expert ids per MoE layer
(models/common/routing_replay.py, int8 up to 128 experts). For a 30B-A3B model (48 MoE layers, top 8 of 128)
that is 384 B per token: small next to its KV cache, but it lives on the device while a sample decodes, on the
host until the update, and crosses the bridge to the training ranks in asynchronous GRPO.
"""
from __future__ import annotations

from typing import Any

from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.routing_replay import route_dtype, routes_bytes_per_token
from megatron_vlm.plan.memory import gib

__all__ = ["routes_plan"]


def routes_plan(model: Any, rl: Any, *, per_rank_prompts: int, batch_prompts: int, max_tokens: int) -> tuple[list[str], int]:
    """(the plan's lines, the device bytes of the decode buffer per rank) for a GRPO job on the built-in engine;
    ([], 0) for a model without MoE layers or the vLLM back end (which records nothing)."""
    layers = moe_layers(model)
    if not layers or rl.rollout_backend != "builtin":
        return [], 0
    k, experts = int(layers[0].top_k), int(layers[0].num_experts)
    per_token = routes_bytes_per_token(len(layers), k, experts)
    group, budget = rl.batch.group_size, rl.rollout.max_new_tokens
    device = batch_prompts * group * budget * per_token  # the engine's buffer: every slot's generated tokens
    step = per_rank_prompts * group * max_tokens * per_token  # host: every sample's prompt + completion (bound)
    mode = "replayed in the training forwards" if rl.routing_replay == "rollout" else "compared only (routing_replay 'off')"
    dtype = str(route_dtype(experts)).replace("torch.", "")
    lines = [f"routes     {len(layers)} MoE layers x top-{k} of {experts} experts = {per_token} B per token ({dtype}), {mode}",
             f"           decode buffer {gib(device)} per rank; per step <= {gib(step)} per rank on the host "
             f"({per_rank_prompts} prompts x group {group} x {max_tokens} tokens), moved once to the training forwards"
             + (" and over the bridge to the training ranks" if rl.allocation is not None else "")]
    return lines, device
