"""InternVL parallelisation: the shared `make_parallelize` body.

The model is dense, so of TP -> EP -> CP -> activation checkpointing -> compile -> FSDP all but EP and
CP apply. TP plan (`parallel.tp`): each decoder layer's `self_attn` split by heads and `mlp` by columns,
vocab-parallel embedding and lm_head; InternViT and the projector are replicated over the tp ranks. Activation checkpointing covers `model.transformer_blocks()` (InternViT layers and
decoder layers); the FSDP units are the decoder layers only: InternViT, the projector, embeddings,
final norm and lm_head stay in the root unit, so a rank whose micro-batch has no image still reduces
the same parameters as the others (and tied embeddings stay in one group).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_internvl = make_parallelize("internvl", tp_layer_children={"self_attn": "attention", "mlp": "mlp"})
