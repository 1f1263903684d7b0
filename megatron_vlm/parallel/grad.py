"""Gradient-norm clipping that is correct for sharded (DTensor) gradients: the norm of each
shard is combined across ranks (`full_tensor`) before the clip coefficient is computed.

Gradients may live on different meshes (FSDP parameters on the data-parallel mesh, expert-parallel
weights on the ("ep_replicate", "ep") mesh), and DTensor ops cannot mix meshes: the norm is computed
per mesh, made whole there (a shard counts once, a replica is not counted again), the per-mesh norms
are combined, and each mesh's gradients are scaled by the one global coefficient.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def _group_by_mesh(params):
    groups: dict = {}
    for p in params:
        key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so their global norm is at most `max_norm`
    (0 = only measure); returns the global norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    groups = _group_by_mesh(params)
    norms = []
    for group in groups:
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type, foreach=None)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if len(norms) == 1:
        total = norms[0]
    else:
        device = norms[0].device
        stacked = torch.stack([n.to(device, torch.float32) for n in norms])
        total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    if max_norm > 0:
        # clip_grads_with_norm_ takes the parameters (it scales their .grad), one mesh at a time.
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
    return total
