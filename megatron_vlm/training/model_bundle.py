"""The model side of a training run, built once by `build_model_bundle(ctx)`: the family model
loaded from `model.path` with `train.train_layers` applied, its FSDP2 sharding on the device mesh,
the `[lora]` adapters when configured, the `TokenLogprobModel` root that every training / evaluation /
rollout forward goes through, the processor, the trainable parameters and — for models with MoE layers — the load balancer.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_vlm import kernels
from megatron_vlm.checkpoint.hf import load_hf_model, read_hf_config
from megatron_vlm.checkpoint.score_folder import model_folder_refusal
from megatron_vlm.data.processor import load_processor
from megatron_vlm.errors import ConfigError
from megatron_vlm.models import get_family
from megatron_vlm.models.common.mamba2 import Mamba2Mixer
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.parallel_plan import check_expert_parallel
from megatron_vlm.models.mcore.layer import use_mcore_layers
from megatron_vlm.parallel import ParallelDims, build_mesh
from megatron_vlm.parallel.collectives import all_reduce_
from megatron_vlm.parallel.master_weights import MasterWeights
from megatron_vlm.parallel.mesh import build_ep_mesh
from megatron_vlm.parallel.pipeline import (
    PipelineRunner,
    check_pipeline_layout,
    split_model_for_stage,
    stage_all_reduce,
    stage_gather_objects,
)
from megatron_vlm.parallel.precision import mixed_param_dtype, resolve_precision
from megatron_vlm.training.context import RunContext, seed_everything
from megatron_vlm.training.fp8 import convert_to_fp8
from megatron_vlm.training.freeze import apply_train_layers
from megatron_vlm.training.lm_loss import TokenLogprobModel
from megatron_vlm.training.lora import LoRASetupError, setup_lora
from megatron_vlm.training.moe_balancing import MOE_BIAS, MoELoadBalancer, check_router_settings

__all__ = ["ModelBundle", "build_model_bundle"]

log = logging.getLogger("megatron_vlm")


@dataclass
class ModelBundle:
    model: torch.nn.Module
    """The family model (sharded in place)."""
    wrapper: TokenLogprobModel
    """The FSDP root: token log-probs for training, `wrapper(model_kwargs=...)` for logits / decoding."""
    processor: Any
    dims: ParallelDims
    mesh: Any
    trainable_params: list
    moe_balancer: Optional[Any] = None
    """`MoELoadBalancer` when the model has MoE layers, else None."""
    pipeline: Optional[Any] = None
    """`PipelineRunner` with parallel.pp > 1 (this rank's stage; the SFT step runs through it), else None."""
    num_params: int = 0
    """Parameters of the whole model (every pipeline stage's; `mfu`'s N), counted before a stage split."""
    layer_kinds: frozenset = frozenset()
    """The kinds of layers ("MoE", "Mamba2"; `MOE_BIAS`: MoE routers with a score-correction bias) of the whole model,
    whichever pipeline stage this rank holds: what the `[moe]` section and the layer kernels of `[kernels]` are
    checked against (a stage may hold none of them)."""


def _load_all_reduce(dims: ParallelDims) -> Callable[[torch.Tensor], Any]:
    """Sum of the MoE loads over the ranks, each token counted once: the tp ranks of a group route the
    same tokens (MoE blocks are replicated over tp), while the cp ranks of a group route disjoint halves
    of them (context parallelism splits the MoE layers' tokens), so only tp copies are divided out."""
    if dims.tp == 1:
        return all_reduce_

    def reduce(t: torch.Tensor) -> torch.Tensor:
        all_reduce_(t)
        return t.div_(dims.tp, rounding_mode="floor") if not t.is_floating_point() else t.div_(dims.tp)
    return reduce


def use_mcore_backend(model, tp_mesh=None, ep_mesh=None, grad_divide_factor: float = 1.0) -> None:
    """`parallel.backend = "mcore"`: swap the language decoder's layers for megatron-core ones (McoreBackendError,
    exit 2, when the family's layers cannot be mapped) and say so at startup. `tp_mesh` (parallel.tp > 1): the
    layers are built tensor-parallel over it, each rank holding its blocks. `cp` > 1 (dense, MoE and Nemotron-H
    decoders alike) needs nothing here: the family's `parallelize` splits the layers as the native ones (the Mamba2
    blocks left whole, `models/common/parallel_plan.py`). `ep_mesh` (parallel.ep > 1):
    the MoE layers hold their rank's experts (models/mcore/ep_shard.py), gradients divided by `grad_divide_factor`
    (the data-parallel size)."""
    use_mcore_layers(model, tp_mesh=tp_mesh, ep_mesh=ep_mesh, grad_divide_factor=grad_divide_factor)
    layers = model.language_model.layers
    kinds = ", ".join(sorted({type(layer.mcore).__name__ for layer in layers}))
    log.info("parallel.backend = mcore: %d language-decoder layers are megatron-core layers (%s; %s layer spec, "
             "tensor_model_parallel_size %d, expert_model_parallel_size %d); experimental: the local spec has run on one "
             "GPU (H100), Transformer Engine's spec and multi-GPU layouts not yet",
             len(layers), kinds, "Transformer Engine" if layers[0].te_fused_norms else "local", getattr(layers[0], "tp", 1),
             max(getattr(layer, "ep", 1) for layer in layers))


def fsdp_needed(world_size: int, precision: str, device_type: str, setting: Union[bool, str] = "auto") -> bool:
    """Whether the model becomes FSDP2 units. One CPU process in full precision has nothing to shard, gather
    or reduce, and FSDP2's per-unit hooks and copies were ~40 ms of a ~1.1 s GRPO step there (3 %,
    benchmarks/RESULTS.md); so its parameters stay plain tensors. Everywhere else FSDP2 stays: bf16 needs its
    MixedPrecisionPolicy (fp32 parameters cast for the forward, gradients reduced in fp32), and on a GPU / NPU
    it is also what moves the parameters, loaded on the CPU, to the device. Checkpoints are DCP either way (a
    plain tensor loads into a DTensor shard and back), so a run resumes at another process count. `setting`
    (`parallel.fsdp`): true always, false never (one process: `world_size` > 1 is a ConfigError, exit 2; in bf16 the
    weights are bf16 with fp32 masters beside them, parallel/master_weights.py), "auto" as above."""
    if setting is False:
        if world_size > 1:
            raise ConfigError(f"parallel.fsdp: false runs one process; this run has {world_size} (use \"auto\")")
        return False
    return setting is True or world_size > 1 or precision == "bf16" or device_type != "cpu"


def place_unsharded(wrapper: torch.nn.Module, device: torch.device, precision: str, *,
                    train: bool = True) -> Optional[MasterWeights]:
    """A model without FSDP2 units (`parallel.fsdp` false, or "auto" on one CPU process in fp32) on `device`, where
    FSDP2 would have moved it; in bf16 its weights become bf16 with fp32 masters beside them: its `MasterWeights`.
    The masters are made before the move, so a frozen parameter reaches the device in bf16 only (moved in fp32 first,
    a LoRA run's base model stood there twice over the bf16 weights that --check counts). `train` False (an evaluation
    job): no fp32 copy is kept."""
    masters = MasterWeights(wrapper, torch.bfloat16, device=device, keep=train) if precision == "bf16" else None
    if device.type != "cpu":  # the rest: buffers, fp32_weight modules, parameters already in bf16
        wrapper.to(device)
    return masters


def build_model_bundle(ctx: RunContext, *, root: Callable[[torch.nn.Module], Any] = TokenLogprobModel) -> ModelBundle:
    """Configure the kernels, seed every RNG with `train.seed`, build the mesh, load, freeze and shard
    the model. Same order on every rank (the sharding is collective). `root(model)`: the module made the FSDP
    root around the family model (default the log-prob wrapper; reward-model training passes its scalar-head
    root, training/reward/model.py)."""
    cfg, env = ctx.cfg, ctx.env
    if (Path(cfg.model.path) / "config.json").is_file():  # a reward model folder: exit 2, not a traceback at its weights
        refused = model_folder_refusal(read_hf_config(cfg.model.path), cfg.model.path, cfg.train.mode)
        if refused:
            raise ConfigError(refused)
    kernels.configure(cfg.kernels)
    seed_everything(cfg.train.seed)
    dims, mesh = build_mesh(cfg.parallel, env.world_size, env.device.type)  # LayoutError: exit 2 (runner)
    processor = load_processor(cfg.model.path, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels,
                               video_min_pixels=cfg.data.video_min_pixels, video_max_pixels=cfg.data.video_max_pixels,
                               chat_template_kwargs=cfg.data.chat_template_kwargs)
    model: Any = load_hf_model(cfg.model.path, dtype=getattr(torch, cfg.model.dtype), device="cpu")  # a family model
    lora = getattr(cfg, "lora", None)  # [lora] section (None: full fine-tuning)
    if lora is not None:  # adapters before sharding: FSDP2 wraps them with the rest of each block
        try:
            setup_lora(model, lora, model.hf_config)
        except (ValueError, FileNotFoundError) as e:  # a wrong [lora] key / adapter folder: exit 2, like a config error
            raise LoRASetupError(str(e)) from None
    # parallel.ep the model cannot take: exit 2 before the megatron-core conversion or the expert plan shards anything
    check_expert_parallel(model, str(model.hf_config.get("model_type")), dims.ep)
    if cfg.parallel.backend == "mcore":  # megatron-core decoder layers, converted from the loaded weights; after
        # [lora] (targets, init_from, merge on the native layers): each layer takes over its native adapters' factors
        ep_mesh = build_ep_mesh(dims, env.device.type) if dims.ep > 1 else None  # the native ep groups (collective)
        use_mcore_backend(model, tp_mesh=mesh["tp"] if dims.tp > 1 else None, ep_mesh=ep_mesh,
                          grad_divide_factor=dims.dp_size)
    trainable, total = apply_train_layers(model, cfg.train.train_layers)
    if lora is not None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model %s: %.2fM parameters, %.2fM trainable", type(model).__name__, total / 1e6, trainable / 1e6)
    whole_moe = moe_layers(model)  # before a pipeline split leaves this rank only its stage's layers
    num_params = sum(p.numel() for p in model.parameters())
    layer_kinds = frozenset(kind for kind, present in (("MoE", bool(whole_moe)), ("Mamba2", any(
        isinstance(m, Mamba2Mixer) for m in model.modules())), (MOE_BIAS, any(
            layer.gate.e_score_correction_bias is not None for layer in whole_moe))) if present)
    wrapper: Any = root(model)  # or, with pp, the stage's PipelineStageModel root
    precision = resolve_precision(cfg.train.precision, env.device)
    pp = cfg.parallel.pp
    if pp > 1:  # keep only this rank's pipeline stage (parallel/pipeline.py); LayoutError: exit 2
        check_pipeline_layout(model, cfg.parallel, env.world_size)
        check_router_settings(whole_moe, cfg.moe)  # the whole model's routers: a stage sees only its own
        act_dtype = torch.bfloat16 if precision == "bf16" else getattr(torch, cfg.model.dtype)
        wrapper = split_model_for_stage(model, TokenLogprobModel, stage=mesh.get_local_rank("pp"), pp=pp,
                                        max_tokens=cfg.data.max_tokens_per_pack, act_dtype=act_dtype)
    if cfg.train.precision == "fp8":  # before sharding, as torchao's FSDP2 integration expects
        convert_to_fp8(model, cfg.train.fp8_recipe, env.device)
    family = get_family(model.hf_config.get("model_type"))
    fsdp_mesh = mesh if fsdp_needed(env.world_size, precision, env.device.type, cfg.parallel.fsdp) else None
    if fsdp_mesh is None and precision == "bf16":
        log.info("parallel.fsdp = false: no FSDP2 units; bf16 weights with fp32 master copies in the optimizer")
    elif fsdp_mesh is None:
        log.info("one %s process in %s precision: parameters stay plain tensors (no FSDP2 units: nothing to shard "
                 "or gather, and their hooks cost ~3%% of a CPU GRPO step)", env.device.type.upper(), precision)
    # a size parallel.tp does not divide raises TPError: a config error (exit 2, megatron_vlm/runner.py)
    family.parallelize(model, dims, cfg.parallel, mesh=fsdp_mesh,
                       activation_checkpointing=cfg.train.activation_checkpointing,
                       param_dtype=mixed_param_dtype(cfg.train.precision, env.device), root=wrapper)
    trainable_params = [p for p in wrapper.parameters() if p.requires_grad]
    masters = place_unsharded(wrapper, env.device, precision, train=cfg.train.mode != "eval") if fsdp_mesh is None else None
    if masters is not None:  # clipping reads the masters' fp32 gradients
        trainable_params = [masters.params_or(p) for p in trainable_params]
    balancer: Optional[MoELoadBalancer] = None
    if pp > 1 and whole_moe:  # each stage balances its own MoE layers (maybe none); reports gather every stage's
        balancer = MoELoadBalancer(model, cfg.moe, all_reduce=stage_all_reduce(mesh), stages=stage_gather_objects(mesh))
    elif whole_moe:
        # cp > 1: every MoE block is in a context-parallel layer (only Mamba2 layers stay whole), routing its chunks
        token_group = mesh["cp"].get_group() if dims.cp > 1 else None
        balancer = MoELoadBalancer(model, cfg.moe, all_reduce=_load_all_reduce(dims), token_group=token_group)
    pipeline = PipelineRunner(wrapper, mesh, env.device, cfg.train.micro_batches_per_step) if pp > 1 else None
    return ModelBundle(model=model, wrapper=wrapper, processor=processor, dims=dims, mesh=mesh,
                       trainable_params=trainable_params, moe_balancer=balancer, pipeline=pipeline,
                       num_params=num_params, layer_kinds=layer_kinds)
