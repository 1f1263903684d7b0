"""Qwen2.5-VL parallel plan: declare the units, call the shared `megatron_vlm.parallel` helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. This family is
dense and its tensor-parallel plan is not declared yet, so only the last three steps apply. The
units are `model.transformer_blocks()` (every vision block and decoder layer); embeddings, merger,
final norm and lm_head stay in the root FSDP group, which also keeps tied embeddings in one group.
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen2_5_vl = make_parallelize("qwen2_5_vl")
