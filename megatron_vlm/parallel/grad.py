"""Gradient-norm clipping that is correct for sharded (DTensor) gradients: the norm of each
shard is combined across ranks before the clip coefficient is computed.

Gradients may live on different meshes (FSDP parameters on the data-parallel mesh, expert-parallel
weights on the ("ep_replicate", "ep") mesh), and DTensor ops cannot mix meshes: the norm is computed
per mesh, made whole there (a shard counts once, a replica is not counted again), the per-mesh norms
are combined, and each mesh's gradients are scaled by the one global coefficient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_by_mesh(params):
    groups: dict = {}
    for p in params:
        key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def _shard_groups(grad: DTensor) -> Optional[list]:
    """The process groups over which `grad`'s local pieces partition it (its mesh dims of more than one rank with a
    Shard placement; Replicate dims hold copies: not summed again), or None when a placement is neither (a Partial
    gradient is not made of disjoint pieces: the DTensor path reduces it)."""
    out = []
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            return None
        if grad.device_mesh.size(dim) > 1:
            out.append(grad.device_mesh.get_group(dim))
    return out


def _local_norm(grads: list[torch.Tensor], groups: list, norm_type: float) -> torch.Tensor:
    """The norm of tensors split over `groups` from their local pieces: the pieces' norm, combined over the groups
    (max for inf, else the p-th powers summed)."""
    n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
    if not groups:
        return n
    if math.isinf(norm_type):
        for group in groups:
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        return n
    n = n.pow(norm_type)
    for group in groups:
        dist.all_reduce(n, group=group)
    return n.pow(1.0 / norm_type)


def _scale_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """`torch.nn.utils.clip_grads_with_norm_`'s scaling of `grads` themselves (it takes their parameters)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), same in by_device.items():
        torch._foreach_mul_(same, coef.to(device))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so their global norm is at most `max_norm`
    (0 = only measure); returns the global norm before clipping.

    Sharded gradients (FSDP's Shard(0), with Replicate dims under HSDP) are measured and scaled through their local
    pieces, with one all-reduce per mesh dim they are split over: the same kernels as DTensor's own foreach norm and
    multiply, without its Python dispatch (host time for the 952 gradients of the Qwen2.5-VL-3B structure: 9.1 ->
    5.0 ms, benchmarks/RESULTS.md), which the step's optimizer update waits for. Other placements (a Partial
    gradient, mixed placements on one mesh) keep the DTensor path."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    groups = _group_by_mesh(params)
    norms, scaled = [], []
    for group in groups:
        grads = [p.grad for p in group]
        shard_groups = _shard_groups(grads[0]) if isinstance(grads[0], DTensor) else []
        if shard_groups is not None and all(not isinstance(g, DTensor) or g.placements == grads[0].placements
                                            for g in grads):
            local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
            norms.append(_local_norm(local, shard_groups, norm_type))
            scaled.append(local)
            continue
        n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
        scaled.append(group)
    if len(norms) == 1:
        total = norms[0]
    else:
        device = norms[0].device
        stacked = torch.stack([n.to(device, torch.float32) for n in norms])
        total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    if max_norm > 0:
        for group, items in zip(groups, scaled):
            if items is group:  # clip_grads_with_norm_ takes the parameters (it scales their .grad)
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
            else:
                _scale_(items, max_norm, total)
    return total
