"""Qwen2.5-VL parallelisation: the shared `make_parallelize` body.

This family is dense, so of TP -> EP -> CP -> activation checkpointing -> compile -> FSDP all but EP
and CP apply. TP plan (`parallel.tp`): each decoder layer's `self_attn` split by heads and `mlp` by
columns, vocab-parallel embedding and lm_head; the vision tower is replicated over the tp ranks. Activation checkpointing covers `model.transformer_blocks()` (every vision block
and decoder layer); the decoder layers are the FSDP units; embeddings, merger, final norm and lm_head
stay in the root FSDP group, which also keeps tied embeddings in one group.
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen2_5_vl = make_parallelize("qwen2_5_vl", tp_layer_children={"self_attn": "attention", "mlp": "mlp"})
