"""The shared body of every family's `parallelize_<family>`: one factory, so that each family's
`parallelize.py` only names what it does not support and the call into `megatron_vlm.parallel` is
written once.

Order: TP -> EP -> CP -> activation checkpointing -> compile -> FSDP (each step must see the module
layout the previous one left: FSDP shards whatever TP / EP did not already place). With `parallel.tp`
> 1 the family's TP plan (attention heads and MLP columns sharded, vocab-parallel embedding and
lm_head; `megatron_vlm.parallel.tensor_parallel`) is applied on the "tp" dim of the world mesh, and
FSDP2 then shards those DTensors over the data-parallel dims (2-D FSDP x TP). With `parallel.ep` > 1 the routed experts of every
MoE block are sharded over the ("ep_replicate", "ep") mesh (`megatron_vlm.parallel.apply_ep`) and left
out of FSDP (`ignored_params`; with `parallel.backend = "mcore"` the megatron-core MoE layers were built
holding their rank's experts, models/mcore/ep_shard.py, and are only left out of FSDP here); their
gradients are summed over the replicas and divided by the data-parallel size, as FSDP averages the others (the loops scale the loss by it). With `parallel.cp` > 1
every decoder layer without a Mamba2 mixer becomes context-parallel for packed input
(`megatron_vlm.parallel.context_parallel`). Activation checkpointing covers
`model.transformer_blocks()`; the FSDP units are the decoder layers (`model.language_model.layers`):
the vision tower, projector, embeddings, final norm and lm_head stay in the root unit, so a rank
whose micro-batch has no image still reduces the same parameters as the others (and tied embeddings
stay in one group).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from megatron_vlm.models.common.mamba2 import Mamba2Mixer
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.mcore.ep_shard import ep_expert_parameters
from megatron_vlm.parallel import apply_ep, expert_parameters, parallelize_blocks
from megatron_vlm.parallel.apply import apply_input_casts
from megatron_vlm.parallel.context_parallel import ContextParallel, apply_cp
from megatron_vlm.parallel.mesh import LayoutError, build_ep_mesh
from megatron_vlm.parallel.tensor_parallel import apply_tp

log = logging.getLogger("megatron_vlm")


def unit_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that are FSDP2 units of their own (the decoder layers; module docstring), and so cast their
    floating-point inputs under mixed precision."""
    return list(model.language_model.layers)


def copy_input_casts(model: nn.Module, param_dtype: Optional[torch.dtype], *, root: Optional[nn.Module] = None) -> None:
    """Give a copy of the policy that is not trained (a rollout engine's own weights: rl.rollout.weights = "copy" /
    "expert_parallel", the asynchronous rollout ranks; GRPO's frozen reference) the input casts the trainer's mixed
    precision makes at its root (`root`, default `model`: the module called with the inputs) and units
    (`apply_input_casts`; nothing for `param_dtype` None or fp32). Why: the copy holds the trainer's bf16 weights,
    but without the casts the rotary tables, made in fp32, reach its decoder layers uncast and the q / k rotation
    runs in fp32: another policy than the one trained (log-probs ~1e-3 off the trainer's in a tiny bf16 model;
    rollouts drew some tokens "shared" does not, the KL penalty was not 0 at the reference's own weights). With
    them the copy computes what the trainer's forward computes, bit for bit on the same weights."""
    if param_dtype is not None and param_dtype != torch.float32:
        apply_input_casts(root if root is not None else model, unit_blocks(model), param_dtype)


def make_parallelize(
    family: str, *, unsupported_dims: tuple[str, ...] = (), note: str = "",
    tp_layer_children: Optional[dict[str, str]] = None, tp_embedding: str = "language_model.embed_tokens",
) -> Callable[..., nn.Module]:
    """`parallelize_<family>(model, parallel_dims, parallel_cfg, *, mesh, activation_checkpointing,
    param_dtype, root)`. A size > 1 in one of `unsupported_dims` ("tp", "ep", "cp") of `parallel_dims`
    raises NotImplementedError (with `note` appended) instead of silently running replicated.

    The family's TP plan: `tp_layer_children` (decoder-layer child -> "attention" / "mlp" / "replicated"
    / "auto", see `megatron_vlm.parallel.tensor_parallel.apply_tp`) and `tp_embedding` (the token
    embedding's dotted name); a family without `tp_layer_children` refuses parallel.tp > 1."""
    if tp_layer_children is None and "tp" not in unsupported_dims:
        unsupported_dims = (*unsupported_dims, "tp")

    def parallelize(
        model: nn.Module,
        parallel_dims,
        parallel_cfg,
        *,
        mesh=None,
        activation_checkpointing: bool | str = False,
        param_dtype: Optional[torch.dtype] = None,
        root: Optional[nn.Module] = None,
    ) -> nn.Module:
        for dim in unsupported_dims:
            size = getattr(parallel_dims, dim, 1) if parallel_dims is not None else 1
            if size and size > 1:
                suffix = f" ({note})" if note else ""
                raise NotImplementedError(f"parallel.{dim}={size}: not implemented for {family} yet{suffix}")
        ep = getattr(parallel_dims, "ep", 1) if parallel_dims is not None else 1
        check_expert_parallel(model, family, ep)  # before anything is placed: a LayoutError is exit 2
        tp = getattr(parallel_dims, "tp", 1) if parallel_dims is not None else 1
        if tp > 1:
            if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
                raise NotImplementedError(f"parallel.tp={tp}: tensor parallelism needs the world device mesh")
            apply_tp(model, mesh["tp"], layer_children=tp_layer_children, embedding=tp_embedding)
        ignored = None
        if ep > 1:
            _apply_expert_parallel(model, family, parallel_dims, mesh)
            ignored = set(expert_parameters(model)) | set(ep_expert_parameters(model))
        cp = getattr(parallel_dims, "cp", 1) if parallel_dims is not None else 1
        if cp > 1:
            _apply_context_parallel(model, cp, mesh)
        return parallelize_blocks(model, model.transformer_blocks(), parallel_cfg, mesh=mesh,
                                  activation_checkpointing=activation_checkpointing, param_dtype=param_dtype,
                                  root=root, fsdp_blocks=unit_blocks(model), ignored_params=ignored)

    parallelize.__name__ = parallelize.__qualname__ = f"parallelize_{family}"
    parallelize.__doc__ = (
        f"Apply AC / compile / FSDP2 to a {family} model in place and return it. `mesh` None skips FSDP (one "
        "device); `root` = the module to make the root FSDP unit (the trainer's log-prob wrapper)."
    )
    return parallelize


def check_expert_parallel(model: nn.Module, family: str, ep: int) -> None:
    """LayoutError (a config error: exit 2) when `parallel.ep` = `ep` > 1 cannot split `model`'s routed experts: a
    model without MoE blocks, or an expert count `ep` does not divide (each rank must hold as many experts). The
    job's own form of `--check`'s refusal (plan/check.py), found before anything is sharded; without it the expert
    plan's ValueError left every rank with a traceback and exit 1."""
    if ep <= 1:
        return
    layers = moe_layers(model)
    if not layers:
        raise LayoutError(f"parallel.ep: {ep}: the {family} model has no MoE blocks (expert parallelism splits routed "
                          "experts); set parallel.ep = 1")
    for n in sorted({layer.num_experts for layer in layers}):
        if n % ep:
            raise LayoutError(f"parallel.ep: {ep} does not divide the model's {n} routed experts per MoE block (each "
                              "rank holds the same number); set parallel.ep to a divisor of it")


def _apply_expert_parallel(model: nn.Module, family: str, parallel_dims, mesh) -> None:
    layers = moe_layers(model)
    if layers and ep_expert_parameters(model):  # parallel.backend = "mcore": its MoE layers were built sharded
        log.info("expert parallelism: %d megatron-core MoE layers, %d of %d routed experts per rank (parallel.ep=%d)",
                 len(layers), layers[0].num_experts // parallel_dims.ep, layers[0].num_experts, parallel_dims.ep)
        return
    if mesh is None:
        raise NotImplementedError(f"parallel.ep={parallel_dims.ep}: expert parallelism without a device mesh "
                                  "(one process, no FSDP) is not supported; run it under torchrun")
    apply_ep(layers, build_ep_mesh(parallel_dims, mesh.device_type), grad_divide_factor=parallel_dims.dp_size)
    log.info("expert parallelism: %d MoE layers, %d of %d routed experts per rank (parallel.ep=%d)",
             len(layers), layers[0].num_experts // parallel_dims.ep, layers[0].num_experts, parallel_dims.ep)


def _apply_context_parallel(model: nn.Module, cp: int, mesh) -> None:
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        raise NotImplementedError(f"parallel.cp={cp}: context parallelism needs the device mesh; run it under torchrun")
    cp_mesh = mesh["cp"]
    layers = [layer for layer in model.language_model.layers
              if not any(isinstance(m, Mamba2Mixer) for m in layer.modules())]
    n = apply_cp(layers, ContextParallel(cp_mesh.get_group(), cp, cp_mesh.get_local_rank()))
    log.info("context parallelism: %d of %d decoder layers split over %d ranks (Mamba2 layers run the whole "
             "sequence)", n, len(model.language_model.layers), cp)
