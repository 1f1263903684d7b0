"""Qwen2.5-VL parallel plan: declare the units, call the shared `megatron_vlm.parallel` helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. This family is
dense and its tensor-parallel plan is not declared yet, so only the last three steps apply. The
units are `model.transformer_blocks()` (every vision block and decoder layer); embeddings, merger,
final norm and lm_head stay in the root FSDP group, which also keeps tied embeddings in one group.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.parallel import parallelize_blocks


def parallelize_qwen2_5_vl(
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
