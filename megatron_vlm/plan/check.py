"""`launch/pretrain_vlm.py --config x.toml --check`: will this run start and fit? Answered in seconds,
with no weights, no process group and no accelerator needed.

Steps: the keys this job kind ignores (config/mode_keys.py); the model folder's config.json (a
`model.synthesize` tiny model is described by a temporary synthesized folder); the model built on
the meta device (`build_model` under `torch.device("meta")`: shapes only); `train.train_layers`,
`[moe]` on a dense model; the parallel layout for `world_size` ranks (dp_replicate x dp_shard x tp x cp =
world, ep divides the data-parallel ranks and the expert count, tp divides the vocabulary and every
decoder layer's attention / KV heads and MLP width); GRPO sizes (room for a prompt before
rl.rollout.max_new_tokens in data.max_tokens_per_pack, prompts per rank, the rollout batch); then the memory
per rank (plan/memory.py; PPO's critic and the reward models / judges beside the policy: plan/side_models.py)
against the device's. Exit 0 with a one-screen plan, or 2 with one line
`check failed: <dotted key>: <why>` on stderr naming the key to change (the plan on stdout when
memory is the problem).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Optional, TextIO

import torch

from megatron_vlm.checkpoint.score_folder import model_folder_refusal
from megatron_vlm.config.loader import ConfigError
from megatron_vlm.config.mode_keys import check_keys_for_mode, check_moe_section
from megatron_vlm.config.stage_configs import stage_configs
from megatron_vlm.inference.kv_budget import rollout_prompts_for_budget
from megatron_vlm.parallel.apply import ac_policy
from megatron_vlm.parallel.tensor_parallel import TPError, check_tp_divides
from megatron_vlm.plan.memory import GiB, ceil_div, estimate_memory, gib, model_shape, moment_bytes, pipeline_stage_params
from megatron_vlm.plan.routes import routes_plan
from megatron_vlm.plan.side_models import SideModelRefused, side_models_plan
from megatron_vlm.rl.asynchronous.allocation import parse_allocation
from megatron_vlm.rl.prompts.lengths import check_generation_budget

__all__ = ["run_check", "CheckFailed"]

_BYTES = {"float32": 4, "bfloat16": 2}


class CheckFailed(Exception):
    """`key`: the dotted config key (or option) to change."""

    def __init__(self, key: str, why: str, plan: Optional[list[str]] = None):
        super().__init__(f"{key}: {why}")
        self.key, self.plan = key, plan or []


def _read_model_config(cfg) -> dict:
    path = Path(cfg.model.path) / "config.json"
    if path.is_file():
        from megatron_vlm.testing.synthesize import synthesized_mismatch

        mismatch = synthesized_mismatch(cfg.model.synthesize, path.parent)
        if mismatch is not None:
            raise CheckFailed("model.synthesize", mismatch)
        return json.loads(path.read_text())
    if cfg.model.synthesize is None:
        hint = getattr(cfg.rl, "model_path_hint", None) if cfg.train.mode == "grpo" else None  # as the run says it
        raise CheckFailed("model.path", f"{path} does not exist (--check reads the model's config.json, no weights)"
                          + (f"; {hint}" if hint else ""))
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    with tempfile.TemporaryDirectory() as tmp:  # the tiny model the first run would create
        folder = synthesize_model_folder(cfg.model.synthesize, Path(tmp) / "model", seed=cfg.train.seed)
        return json.loads((Path(folder) / "config.json").read_text())


def _meta_model(hf_config: dict):
    from megatron_vlm.models import build_model

    try:
        with torch.device("meta"):
            return build_model(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckFailed("model.path", f"config.json cannot be built: {e}") from None


def _layout(cfg, world: int, num_experts: int) -> tuple[int, int]:
    p = cfg.parallel
    rep, tp, cp, pp = p.dp_replicate, p.tp, p.cp, p.pp
    for key, n in (("parallel.tp", tp), ("parallel.cp", cp), ("parallel.pp", pp)):
        if world % n:
            raise CheckFailed(key, f"{n} does not divide the {world} ranks")
    mp, by = tp * cp * pp, f"parallel.tp {tp} x parallel.cp {cp}" + (f" x parallel.pp {pp}" if pp > 1 else "")
    if world % (rep * mp):
        raise CheckFailed("parallel.dp_replicate", f"{rep} does not divide the {world // mp} data-parallel ranks "
                                                   f"({world} ranks / {by})")
    shard = p.dp_shard if p.dp_shard != -1 else world // (rep * mp)
    if rep * shard * mp != world:
        raise CheckFailed("parallel.dp_shard", f"dp_replicate {rep} x dp_shard {shard} x tp {tp} x cp {cp}"
                                               + (f" x pp {pp}" if pp > 1 else "") + " = "
                                               f"{rep * shard * mp}, not the {world} ranks")
    if world % p.ep or (world // tp) % p.ep:
        raise CheckFailed("parallel.ep", f"{p.ep} does not divide the {world // tp} data-parallel x context-parallel ranks "
                                         f"({world} ranks / parallel.tp {tp})")
    if p.ep > 1 and num_experts == 0:
        raise CheckFailed("parallel.ep", f"{p.ep}: the model has no MoE blocks (expert parallelism splits routed "
                                         "experts); set parallel.ep = 1")
    if p.ep > 1 and num_experts % p.ep:
        raise CheckFailed("parallel.ep", f"{p.ep} does not divide the model's {num_experts} routed experts per MoE block")
    return rep, shard


def _check_template_kwargs(cfg) -> None:
    """data.chat_template_kwargs against the chat template the model folder ships (read from its files), as the job
    checks it when it loads the processor: a name the template never reads fails here, before the queue."""
    kwargs = getattr(cfg.data, "chat_template_kwargs", None)
    if not kwargs:
        return
    from megatron_vlm.data.processor_base import folder_template_text, template_kwargs_refusal

    template = folder_template_text(Path(cfg.model.path))
    refused = template_kwargs_refusal(template, kwargs, cfg.model.path) if template else None
    if refused:
        key, _, why = refused.partition(": ")
        raise CheckFailed(key, why)


def plan_run(cfg, *, world_size: int, device_memory_gib: float) -> list[str]:
    """The plan's lines; raises CheckFailed / ConfigError naming the key to change."""
    check_keys_for_mode(cfg)
    hf = _read_model_config(cfg)
    _check_template_kwargs(cfg)
    refused = model_folder_refusal(hf, cfg.model.path, cfg.train.mode)  # the job's own refusal (model_bundle.py)
    if refused:
        raise CheckFailed("model.path", refused.split(": ", 1)[1])
    if cfg.train.mode != "eval" and cfg.data.type == "synthetic_vqa" and "vision_config" not in hf:
        # the job finds it only as "no usable samples" (every record an image placeholder mismatch)
        raise CheckFailed("data.type", f"'synthetic_vqa' asks questions about images, and {hf.get('model_type')!r} is a "
                                       "text-only model (no vision_config); give it text data (messages_jsonl / hf)")
    model = _meta_model(hf)
    check_moe_section(cfg, model)
    from megatron_vlm.models.common.moe import moe_layers
    from megatron_vlm.training.freeze import apply_train_layers

    try:
        apply_train_layers(model, cfg.train.train_layers)
    except ValueError as e:
        raise CheckFailed("train.train_layers", str(e).split(": ", 1)[-1]) from None
    if getattr(cfg, "lora", None) is not None:  # the adapters' layers are checked here; only they count as trainable
        from megatron_vlm.models.common.lora import apply_lora
        from megatron_vlm.training.lora import select_lora_targets

        try:
            targets = select_lora_targets(model, hf, cfg.lora.target_modules, include_vision=cfg.lora.include_vision)
        except ValueError as e:
            raise CheckFailed("lora.target_modules", str(e).split(": ", 1)[-1]) from None
        apply_lora(model, targets, r=cfg.lora.r, alpha=cfg.lora.alpha)
    if cfg.parallel.backend == "mcore":  # the job's own refusal (layer kinds, routing, adapters), found here too
        from megatron_vlm.models.mcore.layer import McoreBackendError, check_mcore_model

        try:
            check_mcore_model(model)
        except McoreBackendError as e:
            key, _, why = str(e).partition(": ")  # its messages start with the key
            raise CheckFailed(key, why) from None
    moes = moe_layers(model)
    num_experts = moes[0].num_experts if moes else 0
    total_ranks, rollout_ranks = world_size, 0
    if cfg.train.mode == "grpo" and cfg.rl is not None:
        from megatron_vlm.inference.vllm_layout import vllm_layout_refusal

        refusal = vllm_layout_refusal(cfg, world_size, hf)  # the vLLM back end's own refusal at run time, found here too
        if refusal is not None:
            raise CheckFailed(*refusal)
    if cfg.train.mode == "grpo" and cfg.rl is not None and cfg.rl.allocation is not None:
        # asynchronous GRPO: the training ranks form the FSDP layout, the rollout ranks each hold a full copy
        alloc = parse_allocation(cfg.rl.allocation)
        if alloc.world_size != world_size:
            raise CheckFailed("rl.allocation", f"{cfg.rl.allocation!r} = {alloc.rollout} rollout + {alloc.train} training "
                                               f"ranks, but the run has {world_size}")
        world_size, rollout_ranks = alloc.train, alloc.rollout
    if getattr(cfg.parallel, "fsdp", "auto") is False and world_size > 1:  # as the run refuses it (fsdp_needed)
        raise CheckFailed("parallel.fsdp", f"false runs one process; this run has {world_size}"
                                           f"{' training' if rollout_ranks else ''} ranks (use \"auto\")")
    rep, shard = _layout(cfg, world_size, num_experts)
    idle = cfg.rl.data_shards_refusal(rep * shard) if cfg.train.mode == "grpo" and not rollout_ranks else None
    if idle:  # the job's own refusal once its mesh is built (jobs.run_grpo)
        key, _, why = idle.partition(": ")
        raise CheckFailed(key, why)
    tp = getattr(cfg.parallel, "tp", 1)
    try:
        check_tp_divides(model, tp)
    except TPError as e:
        msg = str(e)
        raise CheckFailed("parallel.tp", msg[len("parallel.tp="):] if msg.startswith("parallel.tp=") else msg) from None
    if cfg.parallel.pp > 1:  # layers < stages, DeepStack layers beyond the first stage (parallel/pipeline.py)
        from megatron_vlm.parallel.mesh import LayoutError
        from megatron_vlm.parallel.pipeline import check_pipeline_layout
        try:
            check_pipeline_layout(model, cfg.parallel, world_size)
        except LayoutError as e:
            raise CheckFailed("parallel.pp", str(e)) from None
    shape = model_shape(model)
    tokens = cfg.data.max_tokens_per_pack
    master = _BYTES[cfg.model.dtype]
    # full precision computes in the weights' own dtype (nothing is cast: parallel/precision.py compute_dtype)
    compute = master if cfg.train.precision == "fp32" else 2
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    lora = f"+ {adapters / 1e9:.3f} B LoRA, " if adapters else ""
    lines = [f"model      {hf.get('model_type')}: {(shape.params - adapters) / 1e9:.3f} B parameters "
             f"({lora}{shape.trainable / 1e9:.3f} B trainable), "
             f"{shape.layers} decoder layers, hidden {shape.hidden}",
             f"layout     {world_size} ranks = dp_replicate {rep} x dp_shard {shard} (FSDP) x tp {tp} x cp {cfg.parallel.cp}"
             + (f" x pp {cfg.parallel.pp}" if cfg.parallel.pp > 1 else "") + f", ep {cfg.parallel.ep}",
             f"batch      {tokens} tokens per packed micro-batch, activation checkpointing "
             f"{_ac_words(cfg.train.activation_checkpointing)}"]
    rollout_prompts, group = 0, 0
    evaluating = cfg.train.mode == "eval"
    if evaluating:  # no gradients, no optimizer, no backward: the weights and the generation's KV cache
        ev = cfg.eval
        rollout_prompts, group = ev.batch_size, max(1, ev.samples)
        lines[-1] = (f"eval       forward only: {ev.batch_size} prompts per generation call (eval.batch_size) x "
                     f"{group} completions x {tokens} cache slots (data.max_tokens_per_pack); no gradients or "
                     "optimizer states")
    if cfg.train.mode == "grpo":
        rl = cfg.rl
        check_generation_budget(cfg.data, rl)  # the run's own check (rl/prompts/lengths.py): the same key and line
        per_rank = ceil_div(rl.batch.prompts_per_step, rollout_ranks or world_size // tp)
        group = rl.batch.group_size
        if rollout_ranks:
            lines.append(f"async      {rollout_ranks} rollout + {world_size} training ranks of {total_ranks}, "
                         f"max_head_offpolicyness {rl.asynchronous.max_head_offpolicyness}")
        rollout_prompts = rl.rollout.batch_prompts or rollout_prompts_for_budget(
            rl.rollout.memory_gib, shape.kv_per_slot * compute, group, tokens) or per_rank
        rollout_prompts = min(rollout_prompts, per_rank)
        if rl.rollout_backend == "vllm":  # vLLM holds its own memory (below)
            rollout_prompts = 0
        if rl.rollout.cuda_graphs == "on":  # the engine's own refusal (inference/policy_engine.py), found here too
            from megatron_vlm.inference.policy_engine import cuda_graphs_blocker

            why_not = cuda_graphs_blocker(model)
            if why_not:
                raise CheckFailed("rl.rollout.cuda_graphs", f"'on' is not possible: {why_not}")
        if rl.rollout.kv_block_size:  # the engine's refusal (PagedKVConfigError), found here too
            from megatron_vlm.inference.policy_engine import paged_kv_blocker

            why_not = paged_kv_blocker(model)
            if why_not:
                raise CheckFailed("rl.rollout.kv_block_size", f"{rl.rollout.kv_block_size} (the paged KV cache) is not possible: {why_not}")
        if rl.rollout_backend == "vllm":
            lines.append(f"rollout    {per_rank} prompts per rank and step x group {group}, in the vLLM engine "
                         f"(rl.vllm.max_num_seqs {rl.vllm.max_num_seqs} at once)")
        else:
            if rl.rollout.kv_block_size and rl.rollout.kv_cache_blocks:  # the on-demand pool bounds what runs at once
                positions = (rl.rollout.kv_cache_blocks - 1) * rl.rollout.kv_block_size
                lines.append(f"rollout    {per_rank} prompts per rank and step x group {group}, {rollout_prompts * group} slots "
                             f"sharing a pool of {positions} positions on demand ({positions // tokens} sequences at "
                             f"{tokens} positions; shorter ones more), refilled as completions end")
            else:
                lines.append(f"rollout    {per_rank} prompts per rank and step x group {group}, {rollout_prompts * group} sequences "
                             f"at once ({rollout_prompts} prompts' slots of {tokens} positions), refilled as completions end")
            lines.append(decode_line(cfg, model, rollout_ranks=bool(rollout_ranks)))
        route_lines, routes_bytes = routes_plan(model, rl, per_rank_prompts=per_rank, batch_prompts=rollout_prompts,
                                                max_tokens=tokens)
        lines += route_lines
        if rl.rollout.kv_block_size:
            pool = (f"{rl.rollout.kv_cache_blocks} blocks (rl.rollout.kv_cache_blocks)" if rl.rollout.kv_cache_blocks else
                    "derived: room for every slot at full length")
            lines.append(f"kv cache   paged, {rl.rollout.kv_block_size} positions per block, pool {pool}")
    reference_bytes, grpo = 0, cfg.train.mode == "grpo"
    if not grpo:
        routes_bytes = 0
    if cfg.train.mode == "dpo":  # training/dpo/reference.py: only the full-model on-the-fly reference holds a copy
        dpo = cfg.dpo if getattr(cfg, "dpo", None) is not None else None
        loss, ref_kind = (dpo.loss_type, dpo.reference) if dpo is not None else ("sigmoid", "on_the_fly")
        copy = loss != "simpo" and ref_kind == "on_the_fly" and not adapters
        reference_bytes = (shape.params - adapters) * compute if copy else 0
        what = ("none (reference-free)" if loss == "simpo" else
                f"a frozen unsharded copy of the model, {gib(reference_bytes)} per rank" if copy else
                "the policy with its adapters off" if ref_kind == "on_the_fly" else
                "precomputed once before the first step (no copy held)")
        lines.append(f"dpo        loss {loss}, reference {ref_kind}: {what}")
    if cfg.train.mode == "reward":  # training/reward/: the policy-sized counts below still include the lm_head
        r = cfg.reward
        lines.append(f"reward     Bradley-Terry on pairs (margin {r.margin if r is not None else 0.0:g}): a scalar head on "
                     "the backbone, its lm_head not held (counted below: an over-estimate); export <output_dir>/hf, "
                     "a sequence-classification folder")
    rank_shape = shape
    if cfg.parallel.pp > 1:  # a rank holds one stage: its parameters, not the model's
        from megatron_vlm.parallel.pipeline import stage_layer_range

        stages = pipeline_stage_params(model, cfg.parallel.pp)
        rank_shape = dataclasses.replace(shape, params=max(p for p, _ in stages), trainable=max(t for _, t in stages))
        lines.append(f"pipeline   {cfg.parallel.pp} stages of " + ", ".join(
            f"{hi - lo}" for lo, hi in (stage_layer_range(shape.layers, cfg.parallel.pp, i) for i in range(cfg.parallel.pp)))
            + " decoder layers; parameters per stage " + ", ".join(f"{p / 1e9:.3f} B" for p, _ in stages)
            + " (the largest counted per rank below)")
    if evaluating:
        rank_shape = dataclasses.replace(rank_shape, trainable=0, tp_trainable=0, expert_trainable=0)
    kv_slots = cfg.rl.rollout.kv_cache_blocks * cfg.rl.rollout.kv_block_size if grpo else 0
    # asynchronous GRPO: the training ranks hold no rollout engine (rollout_rank_lines: the rollout ranks' own plan)
    mem = estimate_memory(rank_shape, fsdp=shard * cfg.parallel.cp, master_bytes=master, compute_bytes=compute, tokens=tokens,
                          activation_checkpointing=True if evaluating else cfg.train.activation_checkpointing,
                          rollout_prompts=0 if rollout_ranks else rollout_prompts, group_size=group, tp=tp,
                          kv_slots=kv_slots, ep=cfg.parallel.ep, routes_bytes=0.0 if rollout_ranks else routes_bytes,
                          compiled=cfg.parallel.compile or _splits_for_fp32_units(cfg, model, compute, master),
                          rollout_weights=cfg.rl.rollout.weights if grpo and cfg.rl.rollout_backend == "builtin" else "shared",
                          moment_bytes=moment_bytes(cfg), unsharded=cfg.parallel.fsdp is False)
    if rollout_ranks:
        lines += rollout_rank_lines(cfg, shape, compute_bytes=compute, batch_prompts=rollout_prompts, group=group,
                                    tokens=tokens, kv_slots=kv_slots, routes_bytes=routes_bytes,
                                    device_memory_gib=device_memory_gib, plan=lines)
    try:  # PPO's critic, reward models (plan/side_models.py)
        side = side_models_plan(cfg, hf, build=_meta_model, read=_read_folder_config, tokens=tokens, master_bytes=master,
                                compute_bytes=compute)
    except SideModelRefused as e:
        raise CheckFailed(e.key, e.why) from None
    lines += side.lines
    # held through the run: on top of the static part; on the device only between the policy's activations / KV
    # cache (critic training, an offloaded reward model scoring): counted where larger than those
    side_bytes = side.resident + max(0.0, side.transient - max(mem.activations, mem.kv_cache + mem.routes))
    if cfg.train.mode == "grpo" and cfg.rl.rollout_backend == "vllm" and not rollout_ranks:
        # the vLLM engine takes gpu_memory_utilization of the device for its weights + KV cache; with
        # sleep_mode it gives it back while the trainer's activations need it
        v = cfg.rl.vllm
        vllm_share = v.gpu_memory_utilization * device_memory_gib * GiB
        lines.append(f"vllm       engine {gib(vllm_share)} (rl.vllm.gpu_memory_utilization), sleep_mode {v.sleep_mode}")
        extra = max(0.0, vllm_share - mem.activations) if v.sleep_mode else vllm_share
        if mem.peak + side_bytes + extra > device_memory_gib * GiB:
            raise CheckFailed("rl.vllm.gpu_memory_utilization", f"estimated peak {gib(mem.peak + side_bytes + extra)} per rank with the "
                                                                f"vLLM engine exceeds the device's {device_memory_gib:g} GiB", lines)
    lines += [
        f"memory per {'training ' if rollout_ranks else ''}rank (estimate; formulas in megatron_vlm/plan/memory.py)",
        f"  {_weights_label(cfg)} {gib(mem.params):>12}   gradients {gib(mem.grads):>12}   AdamW {gib(mem.optimizer):>12}",
        f"  gathered block {gib(mem.gathered):>12}   activations {gib(mem.activations)} (checkpointing on "
        f"{gib(mem.activations_ckpt)}, selective {gib(mem.activations_selective)}, off {gib(mem.activations_no_ckpt)})",
        *([] if rollout_ranks else
          [f"  rollout KV cache {gib(mem.kv_cache)}" + (f"   routes buffer {gib(mem.routes)}" if mem.routes else "")]),
        *(rollout_copy_lines(cfg, mem, shape) if grpo and not rollout_ranks else []),
        f"  peak {gib(mem.peak + reference_bytes + side_bytes)} of {device_memory_gib:g} GiB"
        + (f" (with the DPO reference copy {gib(reference_bytes)})" if reference_bytes else "")
        + (f" (with the critic / reward models {gib(side_bytes)})" if side_bytes else ""),
    ]
    excess = mem.peak + reference_bytes + side_bytes - device_memory_gib * GiB
    if excess > 0:
        key = _key_to_change(cfg, mem, side_bytes, excess)
        hint = (f"; bf16 moments (optimizer.moments_dtype = \"bf16\") take {gib(mem.optimizer / 2)} less"
                if key == "optimizer.moments_dtype" else "")
        raise CheckFailed(key, f"estimated peak {gib(mem.peak + reference_bytes + side_bytes)} per rank exceeds the device's "
                               f"{device_memory_gib:g} GiB{hint} (plan on stdout)", lines)
    if grpo and not rollout_ranks:
        lines += copy_hint(cfg, shape.params * compute, mem.peak + reference_bytes + side_bytes, device_memory_gib)
    return lines


def copy_hint(cfg, copy_bytes: float, peak: float, device_memory_gib: float) -> list[str]:
    """With rl.rollout.weights = "shared" (the default) where an own copy of the policy fits as well: a line saying so.
    Why: "shared" decodes through the FSDP root, gathering every block's weights at each decode step, ranks in
    lock-step, and eager (no CUDA graphs); a copy decodes with continuous batching in CUDA graphs on a GPU (5.1x
    transformers `generate` measured at the 3B shape, eager steps 0.83x), for one model's memory more. Not said for
    layouts "copy" does not serve the same way (tp / pp / the megatron-core backend / expert parallelism)."""
    ro, par = cfg.rl.rollout, cfg.parallel
    if cfg.rl.rollout_backend != "builtin" or ro.weights != "shared" or cfg.rl.env is not None:
        return []
    if shared_in_place(cfg):  # "shared" already decodes as a copy would, with no copy's memory
        return []
    if par.tp > 1 or par.pp > 1 or par.ep > 1 or par.backend == "mcore":
        return []
    with_copy = peak + copy_bytes
    if with_copy > device_memory_gib * GiB:
        return []
    return [f"  hint: rl.rollout.weights = \"copy\" fits too (peak {gib(with_copy)} of {device_memory_gib:g} GiB): an own "
            "copy of the policy decodes without gathering weights at every step, in CUDA graphs on a GPU "
            "(rl.rollout.cuda_graphs = \"auto\"); \"shared\" runs eager lock-step steps"]


def _weights_label(cfg) -> str:
    """The memory plan's name for its weights line: an evaluation holds the weights only (no masters: nothing is
    trained), a run without FSDP2 its bf16 weights and their fp32 masters, an FSDP2 run its master weights."""
    if cfg.train.mode == "eval":
        return "weights"
    return "weights+masters" if cfg.parallel.fsdp is False else "master weights"


def shared_in_place(cfg) -> bool:
    """Whether `rl.rollout.weights = "shared"` decodes with the trainer's own bf16 weights as the engine's copy
    (rl/trainer.py `build_rollout_engine`): `parallel.fsdp = false` in bf16 (the plan's "auto" is bf16, as on an
    accelerator), where the model holds bf16 weights beside its fp32 masters. Then nothing is gathered and the engine
    batches continuously, in CUDA graphs on a GPU, as a copy does, without the copy's memory."""
    return cfg.parallel.fsdp is False and cfg.train.precision != "fp32"


def decode_line(cfg, model, *, rollout_ranks: bool) -> str:
    """How the built-in engine's decode steps will run: in CUDA graphs on a GPU, or eager, and why (the choice
    `rl.rollout.cuda_graphs` and `rl.rollout.weights` make, and `parallel.fsdp`; the step's speed differs several-fold
    on a GPU)."""
    rl = cfg.rl
    from megatron_vlm.inference.policy_engine import cuda_graphs_blocker

    mode = rl.rollout.cuda_graphs
    if mode == "off":
        return "decode     eager steps (rl.rollout.cuda_graphs = 'off')"
    if not rollout_ranks and rl.rollout.weights == "shared" and not shared_in_place(cfg):
        return ("decode     eager lock-step steps through the trainer's FSDP model (rl.rollout.weights = 'shared'; "
                "an own copy, 'copy', decodes in CUDA graphs on a GPU)")
    why_not = cuda_graphs_blocker(model)
    if why_not:
        return f"decode     eager steps: {why_not}"
    return f"decode     CUDA graphs on a GPU (rl.rollout.cuda_graphs = {mode!r}), eager on a CPU"


def rollout_rank_lines(cfg, shape, *, compute_bytes: int, batch_prompts: int, group: int, tokens: int, kv_slots: int,
                       routes_bytes: float, device_memory_gib: float, plan: list[str]) -> list[str]:
    """Asynchronous GRPO's rollout ranks (rl/asynchronous/rollout_rank.py): each loads the whole policy in the compute
    dtype and decodes with its own engine (the built-in one's KV pool and routes buffer, or a vLLM engine's share of
    the device); no gradients or optimizer. Checked against the device like the training ranks (`plan`: the lines so
    far, for the error)."""
    weights = shape.params * compute_bytes
    if cfg.rl.rollout_backend == "vllm":
        engine = cfg.rl.vllm.gpu_memory_utilization * device_memory_gib * GiB
        parts, key = f"vLLM engine {gib(engine)} (rl.vllm.gpu_memory_utilization)", "rl.vllm.gpu_memory_utilization"
    else:
        slots = kv_slots if kv_slots else batch_prompts * group * tokens
        kv = shape.kv_per_slot * compute_bytes * slots
        engine = kv + routes_bytes
        parts = f"KV pool {gib(kv)}" + (f" + routes {gib(routes_bytes)}" if routes_bytes else "")
        key = ("rl.rollout.kv_cache_blocks" if kv_slots else
               "rl.rollout.batch_prompts" if cfg.rl.rollout.batch_prompts else "rl.rollout.memory_gib")
    peak = weights + engine
    lines = ["memory per rollout rank (rl.allocation; estimate)",
             f"  policy copy {gib(weights)} (whole, compute dtype) + {parts}",
             f"  peak {gib(peak)} of {device_memory_gib:g} GiB"]
    if peak > device_memory_gib * GiB:
        raise CheckFailed(key if engine > weights else "model.path", f"estimated peak {gib(peak)} per rollout rank exceeds the "
                                                                    f"device's {device_memory_gib:g} GiB (plan on stdout)",
                          plan + lines)
    return lines


def rollout_copy_lines(cfg, mem, shape) -> list[str]:
    """The rollout engine's weights (rl.rollout.weights) and the per-rank sum of the plan's parts."""
    weights = cfg.rl.rollout.weights if cfg.rl.rollout_backend == "builtin" else "vllm"
    what = {"shared": "none: the trainer's bf16 weights, decoded with in place (parallel.fsdp = false)"
                      if shared_in_place(cfg) else
                      "none: the trainer's parameters, all-gathered block by block at every decode step",
            "copy": "an unsharded copy of the whole policy",
            "expert_parallel": f"dense weights whole + 1/{cfg.parallel.ep} of the routed experts "
                               f"({shape.expert_params / 1e9:.2f} B of {shape.params / 1e9:.2f} B parameters are experts)",
            "vllm": "held by the vLLM engine (below)"}[weights]
    policy = mem.params + mem.gathered
    return [f"  rollout copy {gib(mem.rollout_copy)} (rl.rollout.weights = {weights!r}: {what})",
            f"  per rank: policy {gib(policy)} + gradients {gib(mem.grads)} + optimizer {gib(mem.optimizer)} + rollout "
            f"copy {gib(mem.rollout_copy)} + max(activations {gib(mem.activations)}, KV pool {gib(mem.kv_cache)} + "
            f"routes {gib(mem.routes)})"]


def _key_to_change(cfg, mem, side_bytes: float = 0.0, excess: float = 0.0) -> str:
    """The config key whose change most directly brings the plan under the device's memory (`excess` bytes over)."""
    if cfg.train.mode == "eval":
        return "eval.batch_size" if mem.kv_cache > mem.static else "parallel.dp_shard"
    if side_bytes > max(mem.static, mem.activations, mem.kv_cache) and cfg.rl is not None:
        return _side_key(cfg)
    if mem.kv_cache > mem.activations and mem.kv_cache > mem.static:
        if cfg.rl.rollout.kv_cache_blocks:
            return "rl.rollout.kv_cache_blocks"
        return "rl.rollout.batch_prompts" if cfg.rl.rollout.batch_prompts else "rl.rollout.memory_gib"
    if mem.activations > mem.static:
        # off or "selective": whole-block checkpointing (true) is the next saving; already on: fewer tokens
        full = ac_policy(cfg.train.activation_checkpointing) == "full"
        return "data.max_tokens_per_pack" if full else "train.activation_checkpointing"
    if (0 < excess <= mem.optimizer / 2 and getattr(cfg.optimizer, "moments_dtype", "fp32") == "fp32"
            and cfg.parallel.dp_replicate == 1):
        # FSDP already shards over every data-parallel rank: halving the AdamW states is enough, without recomputing
        return "optimizer.moments_dtype"
    if cfg.parallel.fsdp is False:  # dp_shard is refused beside it; FSDP2 shards over more ranks (and drops the bf16 copy)
        return "parallel.fsdp"
    return "parallel.dp_shard"


def _splits_for_fp32_units(cfg, model, compute: int, master: int) -> bool:
    """Whether "selective" checkpointing is split per child and piece without `parallel.compile` too: under FSDP2
    with fp32 modules (Nemotron-H's routers) made units of their own inside bf16 blocks (parallel/apply.py
    `parallelize_blocks`); planned as FSDP2 on an accelerator unless `parallel.fsdp = false`."""
    if cfg.parallel.fsdp is False or ac_policy(cfg.train.activation_checkpointing) != "selective":
        return False
    from megatron_vlm.parallel.apply import fp32_units

    return bool(fp32_units(model, torch.bfloat16 if min(compute, master) < 4 else None))


def _ac_words(value) -> str:
    """train.activation_checkpointing as the plan prints it."""
    return {None: "off", "full": "on (whole blocks)", "selective": "selective (matmul / attention outputs kept)"}[
        ac_policy(value)]


def _side_key(cfg) -> str:
    """The key that shrinks the side models: the critic's folder, else a reward model's offload / path."""
    from megatron_vlm.rl.algorithms.advantage_estimators import needs_critic

    if needs_critic(cfg.rl.advantage):
        return "rl.critic.model"
    for i, r in enumerate(cfg.rl.rewards):
        if getattr(r, "type", "") in ("model", "judge"):
            return f"rl.rewards[{i}].offload" if not r.offload else f"rl.rewards[{i}].path"
    return "parallel.dp_shard"


def _read_folder_config(folder: str) -> dict:
    """config.json of the model folder `folder` named by `rl.critic.model` (the run refuses one without it)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckFailed("rl.critic.model", f"{path} does not exist (a model folder, or 'policy')")
    return json.loads(path.read_text())


def _stage_configs(cfg) -> list:
    """The config of every `[[stages]]` table, planned with the first stage's model (a later stage's
    model is the previous stage's export of the same architecture, not there before the run)."""
    if not getattr(cfg, "stages", None):
        return []
    return [dataclasses.replace(stage_cfg, model=cfg.model) for stage_cfg in stage_configs(cfg)]


def _custom_reward_lines(cfg) -> list[str]:
    """Import the run's custom verifiers in a reward worker as the run will (a ConfigError naming
    `rl.rewards[i].function` if one does not import or cannot take the run's arguments)."""
    rl = getattr(cfg, "rl", None)
    if rl is None:
        return []
    from megatron_vlm.rl.rewards.manager import check_custom_rewards

    n = check_custom_rewards(rl.rewards, timeout_s=rl.reward_pool.timeout_s, memory_limit_mb=rl.reward_pool.memory_limit_mb)
    return [f"rewards    {n} custom verifier(s) import in a reward worker and take the run's arguments"] if n else []


def _env_lines(cfg) -> list[str]:
    """Build the [rl.env] environment as the run will for its tool specs (`environment_tools`: a ConfigError naming
    rl.env.name or rl.env.kwargs when it cannot be), so a misspelt class or argument fails here, not after the
    run has loaded its model."""
    env = getattr(getattr(cfg, "rl", None), "env", None)
    if env is None:
        return []
    from megatron_vlm.rl.env.rollout import environment_tools

    tools = environment_tools(env, verifiers=bool(cfg.rl.rewards))
    names = ", ".join(str(t.get("function", {}).get("name", "?")) for t in tools) or "none"
    return [f"env        {env.name}: built, {len(tools)} tool(s): {names}"]


def visible_device_memory_gib() -> Optional[float]:
    """Memory of this machine's first accelerator in GiB (CUDA, else an NPU through torch_npu's `torch.npu`,
    which reports it the same way), or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return npu.get_device_properties(0).total_memory / GiB
    return None


def run_check(cfg, *, world_size: int, device_memory_gib: Optional[float], out: Optional[TextIO] = None,
              err: Optional[TextIO] = None) -> int:
    """Print the plan and return 0, or print one `check failed: <key>: ...` line (plus the plan when
    memory is the problem) and return 2. `out` / `err` default to the streams of the call (not of the import:
    a redirected sys.stdout / sys.stderr, e.g. a caller capturing the report, is honoured)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if world_size < 1:  # "check ok: 0 ranks" with a negative FSDP shard size is no answer
        print(f"check failed: --world-size: must be >= 1, got {world_size}", file=err)
        return 2
    if device_memory_gib is not None and not (math.isfinite(device_memory_gib) and device_memory_gib > 0):
        print(f"check failed: --device-memory-gib: must be a finite number > 0, got {device_memory_gib:g}", file=err)
        return 2
    if device_memory_gib is None:
        device_memory_gib = visible_device_memory_gib()
        if device_memory_gib is None:
            print("check failed: --device-memory-gib: no accelerator visible; give the device memory in GiB", file=err)
            return 2
    try:
        lines = plan_run(cfg, world_size=world_size, device_memory_gib=device_memory_gib)
        lines += _custom_reward_lines(cfg)
        lines += _env_lines(cfg)
        for stage_cfg in _stage_configs(cfg):  # each [[stages]] table with its own frames / pack size / layers
            stage_lines = plan_run(stage_cfg, world_size=world_size, device_memory_gib=device_memory_gib)
            lines += [f"stage {Path(stage_cfg.train.output_dir).name}:"] + [f"  {x}" for x in stage_lines]
    except (CheckFailed, ConfigError) as e:
        if getattr(e, "plan", None):
            print("\n".join(e.plan), file=out)
        print(f"check failed: {e}", file=err)
        return 2
    print("\n".join(["check ok: " + f"{cfg.train.mode} run, {world_size} ranks", *lines]), file=out)
    return 0
