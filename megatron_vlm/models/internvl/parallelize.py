"""InternVL parallel plan: declare the units, call the shared `megatron_vlm.parallel` helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The shared
helpers provide AC, compile and FSDP2 today; a tensor-parallel plan is not declared yet (the model
is dense, so there is no expert plan). Activation checkpointing covers `model.transformer_blocks()`
(InternViT layers and decoder layers); the FSDP units are the decoder layers only: InternViT, the
projector, embeddings, final norm and lm_head stay in the root unit, so a rank whose micro-batch has
no image still reduces the same parameters as the others (and tied embeddings stay in one group).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.parallel import parallelize_blocks


def parallelize_internvl(
    model: nn.Module,
    parallel_dims,
    parallel_cfg,
    *,
    mesh=None,
    activation_checkpointing: bool = False,
    param_dtype: Optional[torch.dtype] = None,
    root: Optional[nn.Module] = None,
) -> nn.Module:
    """Apply AC / compile / FSDP2 in place and return the model. `mesh` None skips FSDP (one device);
    `root` = the module to make the root FSDP unit (the trainer's log-prob wrapper)."""
    return parallelize_blocks(model, model.transformer_blocks(), parallel_cfg, mesh=mesh,
                              activation_checkpointing=activation_checkpointing, param_dtype=param_dtype, root=root,
                              fsdp_blocks=list(model.language_model.layers))
