"""Expert-parallel shards of a megatron-core MoE decoder layer (`parallel.backend = "mcore"`, `parallel.ep` > 1).

Why a module of its own: megatron-core's `MoELayer` built with expert_model_parallel_size = ep holds only its
rank's `E / ep` experts, as `SequentialMLP.local_experts.{j}` (j = 0 .. E/ep - 1, global expert
`rank * E/ep + j`: megatron-core's `local_expert_indices`, the same contiguous split as our native
`apply_ep`), and nothing maps the full converted layer (`mlp.experts.local_experts.{g}`, g = 0 .. E - 1) to
those slices or back.

In the training run each local expert weight becomes a DTensor on our ("ep_replicate", "ep") mesh
(`Replicate()` over the replicas, `Shard(0)` over ep), so its "global" tensor is the concatenation of local
expert j of every ep rank along dim 0 (`[ep * out, in]`). That gives, as for the native expert weights:
the gradient norm counts each expert once (parallel/grad.py), DCP checkpoints hold every expert, and the
full state dict gathers them; `global_to_full_experts` turns that global tensor back into the per-expert
weights for the HF export. The parameters are left out of FSDP (`ep_expert_parameters`); `local_params`
(tp_shard.py) runs the layer on the local slices, their gradient summed over the replicas and divided by
the data-parallel size (the loss is scaled by it for FSDP's average) — the native path's
`_ReduceGradOverReplicas`. A training checkpoint's global expert rows depend on ep: it records the ep size
(`mcore_ep`) and resuming under another ep is refused (`check_saved_mcore_ep`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from megatron_vlm.models.mcore.tp_shard import check_saved_mcore_size, mcore_size_of
from megatron_vlm.parallel.tensor_parallel import _contiguous_stride

__all__ = ["expert_index", "shard_expert_state", "unshard_expert_state", "global_to_full_experts",
           "distribute_expert_params", "ep_expert_parameters", "mcore_ep_of", "check_saved_mcore_ep"]

_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts\.local_experts\.)(?P<j>\d+)(?P<post>\.linear_fc[12]\.weight)$")


def expert_index(key: str) -> Optional[tuple[str, int, str]]:
    """(prefix, expert index, suffix) of a megatron-core routed-expert weight key; None for any other key."""
    m = _EXPERT.match(key)
    return None if m is None else (m.group("pre"), int(m.group("j")), m.group("post"))


def _num_experts(keys) -> int:
    """The number of routed experts; KeyError unless every expert weight (fc1, fc2) is there for 0 .. n - 1."""
    found: dict[tuple[str, str], set] = {}
    for key in keys:
        idx = expert_index(key)
        if idx is not None:
            found.setdefault((idx[0], idx[2]), set()).add(idx[1])
    n = max((len(v) for v in found.values()), default=0)
    for (pre, post), ids in found.items():
        if ids != set(range(n)):
            raise KeyError(f"expert parallelism: {pre}*{post} has experts {sorted(ids)}, not 0..{n - 1}")
    return n


def shard_expert_state(full: Mapping[str, torch.Tensor], ep: int, rank: int) -> dict[str, torch.Tensor]:
    """A full megatron-core layer state (all E experts) -> rank `rank`'s: experts rank*E/ep .. (rank+1)*E/ep - 1,
    renumbered 0 .. E/ep - 1 (copies); other keys unchanged."""
    n = _num_experts(full)
    if n % ep:
        raise ValueError(f"expert parallelism: {n} routed experts do not split over parallel.ep = {ep} ranks")
    n_local = n // ep
    out = {}
    for key, value in full.items():
        idx = expert_index(key)
        if idx is None:
            out[key] = value
        elif rank * n_local <= idx[1] < (rank + 1) * n_local:
            out[f"{idx[0]}{idx[1] - rank * n_local}{idx[2]}"] = value.clone()
    return out


def unshard_expert_state(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every ep rank's local state (rank order) -> the full state (experts renumbered globally)."""
    n_local = _num_experts(shards[0])
    out = {}
    for rank, shard in enumerate(shards):
        for key, value in shard.items():
            idx = expert_index(key)
            if idx is None:
                out.setdefault(key, value)
            else:
                out[f"{idx[0]}{rank * n_local + idx[1]}{idx[2]}"] = value
    return out


def global_to_full_experts(state: Mapping[str, torch.Tensor], ep: int) -> dict[str, torch.Tensor]:
    """The global tensors of an ep-sharded layer (local expert j: the concatenation along dim 0 of local
    expert j of every ep rank, as its DTensor's full tensor is) -> the full state (E experts)."""
    if ep == 1:
        return dict(state)
    shards = [{} for _ in range(ep)]
    for key, value in state.items():
        for r in range(ep):
            shards[r][key] = value.chunk(ep, dim=0)[r] if expert_index(key) is not None else value
    return unshard_expert_state(shards)


def distribute_expert_params(layer: nn.Module, ep_mesh, grad_divide_factor: float) -> None:
    """Make the routed-expert weights of `layer` (a megatron-core layer holding its rank's experts) DTensors on
    `ep_mesh` (1-D ep, or 2-D (replica, ep)); recorded in `layer._mvlm_ep_owners` for `local_params`, which
    hands megatron-core the local slices with the replica all-reduce / `grad_divide_factor` on their
    gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if grad_divide_factor <= 0:
        raise ValueError(f"expert parallelism: grad_divide_factor must be > 0, got {grad_divide_factor}")
    ep = ep_mesh.size(ep_mesh.ndim - 1)
    replica = ep_mesh.get_group(0) if ep_mesh.ndim == 2 and ep_mesh.size(0) > 1 else None
    placements = [Shard(0)] if ep_mesh.ndim == 1 else [Replicate(), Shard(0)]
    owners = []
    for mod_name, mod in layer.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if expert_index(f"{mod_name}.{name}") is None:
                continue
            shape = [p.shape[0] * ep, *p.shape[1:]]
            d = DTensor.from_local(p.data, ep_mesh, placements, run_check=False, shape=torch.Size(shape),
                                   stride=_contiguous_stride(shape))
            mod.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))
            owners.append((mod, name, replica, float(grad_divide_factor)))
    if not owners:
        raise ValueError("expert parallelism: the megatron-core layer has no routed-expert weights to shard")
    layer._mvlm_ep_owners = owners


def ep_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights `distribute_expert_params` placed on the ep mesh (left out of FSDP)."""
    out = []
    for m in model.modules():
        out += [mod._parameters[n] for mod, n, _, _ in getattr(m, "_mvlm_ep_owners", ())]
    return out


def mcore_ep_of(model: nn.Module) -> Optional[int]:
    """The ep size of `model`'s megatron-core decoder layers (None: it has none)."""
    return mcore_size_of(model, "ep")


def check_saved_mcore_ep(extra: Mapping, ep: Optional[int]) -> None:
    """Refuse a checkpoint whose megatron-core expert weights were saved under another ep size (their global
    rows are laid out per ep rank); without the record it was saved with ep = 1."""
    check_saved_mcore_size(extra, "ep", ep, layers="MoE layers", stored="expert weights")
