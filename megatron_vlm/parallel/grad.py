"""Gradient-norm clipping that is correct for sharded (DTensor) gradients: the norm of each
shard is combined across ranks (`full_tensor`) before the clip coefficient is computed."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=None)
    return total
