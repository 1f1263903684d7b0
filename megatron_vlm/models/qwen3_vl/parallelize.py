"""Qwen3-VL parallel plan: declare the units, call the shared `megatron_vlm.parallel` helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The shared
helpers provide AC, compile and FSDP2 today; tensor / expert parallel plans are not declared yet
(MoE experts are held whole on every rank and sharded by FSDP like any other parameter).
Activation checkpointing covers `model.transformer_blocks()` (vision blocks and decoder layers); the
FSDP units are the decoder layers only: the vision tower (with its DeepStack mergers), embeddings,
final norm and lm_head stay in the root unit, so a rank whose micro-batch has no image still
reduces the same parameters as the others (and tied embeddings stay in one group).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen3_vl = make_parallelize("qwen3_vl")
