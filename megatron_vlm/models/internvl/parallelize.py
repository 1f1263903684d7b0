"""InternVL parallel plan: declare the units, call the shared `megatron_vlm.parallel` helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The shared
helpers provide AC, compile and FSDP2 today; a tensor-parallel plan is not declared yet (the model
is dense, so there is no expert plan). Activation checkpointing covers `model.transformer_blocks()`
(InternViT layers and decoder layers); the FSDP units are the decoder layers only: InternViT, the
projector, embeddings, final norm and lm_head stay in the root unit, so a rank whose micro-batch has
no image still reduces the same parameters as the others (and tied embeddings stay in one group).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_internvl = make_parallelize("internvl")
