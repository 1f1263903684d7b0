"""Tensor-parallel shards of one megatron-core decoder layer (`parallel.backend = "mcore"`, `parallel.tp` > 1).

Why a module of its own: megatron-core's column / row parallel linears hold a rank's local block of each
weight and nothing maps our full (converted, `convert.py`) layer weights to those blocks or back. The
layouts, for `tp` ranks and rank r (megatron-core's `ColumnParallelLinear` splits output rows,
`RowParallelLinear` input columns):

* `self_attention.linear_qkv.weight` / `.bias`: rows grouped per KV head ([q heads of the group, k, v]
  for each group), so rank r's rows are the r-th of `tp` equal row blocks: whole KV groups (tp must
  divide the KV heads) — no reordering needed, the block is exactly megatron-core's local layout;
* `self_attention.linear_proj.weight`: the r-th column block (the outputs of rank r's query heads);
* `mlp.linear_fc1.weight` = [gate; up]: rank r holds [gate_r; up_r] (megatron-core's local GLU chunks
  its output in two), NOT the r-th row block of [gate; up] — the per-shard interleaving below; a
  non-gated fc1 (the Nemotron-H relu^2 MLP, `gated=False`) is a plain row split;
* `mlp.linear_fc2.weight`: the r-th column block;
* norms (input / pre-MLP, per-head QK-norm): whole on every rank;
* anything else (a MoE layer's router, routed and shared experts; a Mamba2 layer's mixer, which splits its
  compute by heads itself, `Mamba2Mixer.tp_shard`): whole on every rank.

In the training run the local blocks become DTensors on the "tp" mesh dim (`Shard(0)` / `Shard(1)` /
`Replicate`), so FSDP2 shards them over the data-parallel dims like the native tp weights, the gradient
norm counts each block once (parallel/grad.py), and the full state dict (checkpoints, HF export) is their
concatenation along the split dim: the "global" tensor. That global tensor is the full weight for every
key but `linear_fc1`, whose global rows are [gate_0; up_0; gate_1; up_1; ...]: `global_to_full` undoes it for
the HF export (and the rollout engine's weight sync). A training checkpoint (DCP) stores the global tensors,
so its fc1 rows depend on tp: it records the tp size (`mcore_tp`) and resuming under another tp is refused
(`check_saved_mcore_tp`) instead of loading permuted rows; the HF export is the layout-free hand-over.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from megatron_vlm.parallel.expert_parallel import _ReduceGradOverReplicas
from megatron_vlm.parallel.tensor_parallel import _contiguous_stride

__all__ = ["SPLIT_DIM", "split_dim", "shard_layer_state", "unshard_layer_state", "global_to_full",
           "distribute_layer_params", "load_local_state", "local_params", "mcore_tp_of", "check_saved_mcore_tp", "check_saved_mcore_size"]

SPLIT_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
"""Layer-relative megatron-core key -> the dim tensor parallelism splits; keys not here stay whole."""

_GLU = "mlp.linear_fc1.weight"
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def split_dim(key: str) -> Optional[int]:
    """The split dim of a layer-relative megatron-core key (None: whole on every rank); `_extra_state`
    and other non-weight entries are whole."""
    return SPLIT_DIM.get(key)


def _shard(key: str, value: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    dim = split_dim(key)
    if dim is None:
        return value
    glu = gated and key == _GLU
    if value.shape[dim] % (2 * tp if glu else tp):
        raise ValueError(f"tensor parallelism: {key} {tuple(value.shape)} does not split into {tp} equal blocks")
    if glu:
        gate, up = value.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return value.chunk(tp, dim=dim)[rank]


def shard_layer_state(full: Mapping[str, torch.Tensor], tp: int, rank: int, *, gated: bool = True) -> dict[str, torch.Tensor]:
    """Full megatron-core layer weights (layer-relative keys) -> rank `rank`'s local blocks (copies). `gated`:
    `mlp.linear_fc1.weight` is [gate; up] (SwiGLU; False: a plain up projection)."""
    return {k: _shard(k, v, tp, rank, gated).clone() for k, v in full.items()}


def unshard_layer_state(shards: list[Mapping[str, torch.Tensor]], *, gated: bool = True) -> dict[str, torch.Tensor]:
    """The local blocks of every rank (rank order) -> the full megatron-core layer weights."""
    out = {}
    for key in shards[0]:
        parts = [s[key] for s in shards]
        dim = split_dim(key)
        if dim is None:
            out[key] = parts[0]
        elif gated and key == _GLU:
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[key] = torch.cat(parts, dim=dim)
    return out


def global_to_full(state: Mapping[str, torch.Tensor], tp: int, *, gated: bool = True) -> dict[str, torch.Tensor]:
    """The global tensors of a tp-sharded layer (each the concatenation of the rank blocks along its split
    dim, as a DTensor's full tensor is) -> the full megatron-core layer weights."""
    if tp == 1:
        return dict(state)
    blocks = [{} for _ in range(tp)]
    for key, value in state.items():
        dim = split_dim(key)
        for r in range(tp):
            blocks[r][key] = value if dim is None else value.chunk(tp, dim=dim)[r]
    return unshard_layer_state(blocks, gated=gated)


def distribute_layer_params(layer: nn.Module, mesh, partial_grad_prefixes: tuple[str, ...] = ()) -> None:
    """Make the parameters of `layer` (a megatron-core TransformerLayer holding rank-local blocks) DTensors on
    the 1-D tp `mesh`; a forward decorated with `local_params` runs megatron-core's modules on the local blocks.
    Split weights are `Shard(dim)` (gradient: this rank's block); the input / pre-MLP norms `Replicate` (plain
    tensor parallelism: they see the whole sequence and receive the same, complete gradient on every tp rank);
    the per-head QK-norms `Replicate` with a `Partial` gradient (each rank normalises its own heads: the
    gradient is summed over the tp ranks, by FSDP2's reduction); so are the parameters under
    `partial_grad_prefixes` (a Mamba2 mixer running its own heads on whole weights: each rank's gradient is
    non-zero on its heads' rows only). Whole blocks replicated over tp (a MoE layer: every rank computes it on
    the whole sequence) are `Replicate` with the same, complete gradient on every tp rank: counted once.
    Parameters that are DTensors already (routed experts under expert parallelism, `ep_shard.distribute_expert_params`:
    on the ep mesh, the same on every tp rank of their group) are left as they are."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    owners = []
    for mod_name, mod in layer.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, DTensor):  # placed already: expert weights on the ep mesh (ep_shard.py)
                continue
            key = f"{mod_name}.{name}" if mod_name else name
            dim = split_dim(key)
            placement = Shard(dim) if dim is not None else Replicate()
            grad = [Partial()] if key in _QK_NORMS or key.startswith(partial_grad_prefixes) else [placement]
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= mesh.size()
            d = DTensor.from_local(p.data, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                   stride=_contiguous_stride(shape))
            mod.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))
            owners.append((mod, name, grad))
    layer._mvlm_tp_owners = owners


def load_local_state(module: nn.Module, local: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load this rank's blocks `local` (converted megatron-core weights) into `module`: copied into the local
    blocks of its DTensor parameters once they are distributed (`distribute_layer_params`), else through
    `load_state_dict`. Returns (missing, unexpected) keys, `_extra_state` entries left out; nothing is copied
    into DTensors unless both are empty."""
    from torch.distributed.tensor import DTensor

    own = module.state_dict()
    if any(isinstance(v, DTensor) for v in own.values()):
        missing = [k for k in own if k not in local and not k.endswith("_extra_state")]
        unexpected = [k for k in local if k not in own]
        if not (missing or unexpected):
            with torch.no_grad():
                for k, v in local.items():
                    (own[k].to_local() if isinstance(own[k], DTensor) else own[k]).copy_(v)
        return missing, unexpected
    missing, unexpected = module.load_state_dict(local, strict=False)
    return [k for k in missing if not k.endswith("_extra_state")], list(unexpected)


def local_params(fn):
    """Decorate a method of a module whose `self.mcore` went through `distribute_layer_params` and / or
    `ep_shard.distribute_expert_params`: during the call, its parameters are the local blocks (autograd flows
    into the DTensor parameters; an expert weight's gradient is summed over its replicas and divided by the
    data-parallel size, as the native expert-parallel weights')."""
    from torch.distributed.tensor import DTensor

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        owners = getattr(self.mcore, "_mvlm_tp_owners", None) or []
        ep_owners = getattr(self.mcore, "_mvlm_ep_owners", None) or []  # ep_shard.distribute_expert_params
        if not (owners or ep_owners):
            return fn(self, *args, **kwargs)
        saved = [(mod, n, mod._parameters[n]) for mod, n, *_ in owners + ep_owners]
        try:
            for (mod, n, p), (_, _, grad) in zip(saved, owners):
                if isinstance(p, DTensor):
                    mod._parameters[n] = p.to_local(grad_placements=grad)
            for mod, n, replica, divide in ep_owners:
                p = mod._parameters[n]
                if isinstance(p, DTensor):
                    mod._parameters[n] = _ReduceGradOverReplicas.apply(p.to_local(), replica, divide)
            return fn(self, *args, **kwargs)
        finally:
            for mod, n, p in saved:
                mod._parameters[n] = p

    return wrapper


def mcore_size_of(model: nn.Module, dim: str) -> Optional[int]:
    """The `dim` ("tp" / "ep") size of `model`'s megatron-core decoder layers (None: it has none)."""
    layers = getattr(getattr(model, "language_model", None), "layers", None) or []
    sizes = {getattr(layer, dim, 1) for layer in layers if hasattr(layer, "mcore")}
    return max(sizes) if sizes else None


def mcore_tp_of(model: nn.Module) -> Optional[int]:
    """The tp size of `model`'s megatron-core decoder layers (None: it has none)."""
    return mcore_size_of(model, "tp")


def check_saved_mcore_size(extra: Mapping, dim: str, size: Optional[int], *, layers: str, stored: str) -> None:
    """Refuse a checkpoint whose megatron-core `layers` were saved under another `dim` ("tp" / "ep") size
    (their `stored` are laid out per rank of it); without the `mcore_<dim>` record it was saved with size 1."""
    if size is None:
        return
    saved = int(extra.get(f"mcore_{dim}", 1))
    if saved != size:
        raise ValueError(f"this checkpoint's megatron-core {layers} were saved with parallel.{dim} = {saved}; with "
                         f"parallel.backend = 'mcore' a checkpoint resumes with the same parallel.{dim} (now {size}): "
                         f"their {stored} are stored per {dim} rank. Resume with parallel.{dim} = {saved}, or start "
                         "from the run's Hugging Face export")


def check_saved_mcore_tp(extra: Mapping, tp: Optional[int]) -> None:
    """Refuse a checkpoint whose megatron-core layers were saved under another tp size (their fc1 rows are
    laid out per tp rank); a checkpoint without the record was saved with tp = 1 (or by the native backend,
    whose parameter names do not match anyway)."""
    check_saved_mcore_size(extra, "tp", tp, layers="layers", stored="linear_fc1 rows")
