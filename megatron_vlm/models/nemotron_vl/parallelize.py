"""Nemotron-H / Nemotron-3-Nano-VL parallel plan: declare the units, call the shared helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The units are
`model.transformer_blocks()` (RADIO layers, then every hybrid decoder block); embeddings, projector,
final norm and lm_head stay in the root FSDP group.

Expert parallelism (MoE experts sharded over the `ep` mesh dim, tokens exchanged with all-to-all)
and tensor parallelism are declared here once `megatron_vlm.parallel` provides `apply_ep` /
`apply_tp`; until then a config asking for them fails loudly instead of silently running
replicated. With FSDP the stacked expert weights `[E, out, in]` are sharded along E like any
other parameter, which is what the seed's single-node runs need.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.parallel import parallelize_blocks

# What the TP / EP helpers will shard once they exist (module path patterns inside a decoder block).
TP_PLAN = {
    "mixer.q_proj": "colwise", "mixer.k_proj": "colwise", "mixer.v_proj": "colwise", "mixer.o_proj": "rowwise",
    "mixer.up_proj": "colwise", "mixer.down_proj": "rowwise",
    "mixer.shared_experts.up_proj": "colwise", "mixer.shared_experts.down_proj": "rowwise",
}
EP_PLAN = {"mixer.experts": "shard_experts_dim0"}


def parallelize_nemotron_vl(
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
    for dim in ("tp", "ep", "cp"):
        size = getattr(parallel_dims, dim, 1) if parallel_dims is not None else 1
        if size and size > 1:
            raise NotImplementedError(f"parallel.{dim}={size}: not implemented for nemotron_vl yet (plans: TP_PLAN / EP_PLAN)")
    return parallelize_blocks(model, model.transformer_blocks(), parallel_cfg, mesh=mesh,
                              activation_checkpointing=activation_checkpointing, param_dtype=param_dtype, root=root,
                              fsdp_blocks=list(model.language_model.layers))
