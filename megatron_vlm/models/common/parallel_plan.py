"""The shared body of every family's `parallelize_<family>`: one factory, so that each family's
`parallelize.py` only declares its plan (DESIGN.md §5) and the call into `megatron_vlm.parallel` is
written once.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The shared
helpers provide AC, compile and FSDP2 today. Activation checkpointing covers
`model.transformer_blocks()`; the FSDP units are the decoder layers (`model.language_model.layers`):
the vision tower, projector, embeddings, final norm and lm_head stay in the root unit, so a rank
whose micro-batch has no image still reduces the same parameters as the others (and tied embeddings
stay in one group).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron_vlm.parallel import parallelize_blocks


def make_parallelize(
    family: str, *, unsupported_dims: tuple[str, ...] = (), note: str = ""
) -> Callable[..., nn.Module]:
    """`parallelize_<family>(model, parallel_dims, parallel_cfg, *, mesh, activation_checkpointing,
    param_dtype, root)`. A size > 1 in one of `unsupported_dims` ("tp", "ep", "cp") of `parallel_dims`
    raises NotImplementedError (with `note` appended) instead of silently running replicated."""

    def parallelize(
        model: nn.Module,
        parallel_dims,
        parallel_cfg,
        *,
        mesh=None,
        activation_checkpointing: bool = False,
        param_dtype: Optional[torch.dtype] = None,
        root: Optional[nn.Module] = None,
    ) -> nn.Module:
        for dim in unsupported_dims:
            size = getattr(parallel_dims, dim, 1) if parallel_dims is not None else 1
            if size and size > 1:
                suffix = f" ({note})" if note else ""
                raise NotImplementedError(f"parallel.{dim}={size}: not implemented for {family} yet{suffix}")
        return parallelize_blocks(model, model.transformer_blocks(), parallel_cfg, mesh=mesh,
                                  activation_checkpointing=activation_checkpointing, param_dtype=param_dtype,
                                  root=root, fsdp_blocks=list(model.language_model.layers))

    parallelize.__name__ = parallelize.__qualname__ = f"parallelize_{family}"
    parallelize.__doc__ = (
        f"Apply AC / compile / FSDP2 to a {family} model in place and return it. `mesh` None skips FSDP (one "
        "device); `root` = the module to make the root FSDP unit (the trainer's log-prob wrapper)."
    )
    return parallelize
