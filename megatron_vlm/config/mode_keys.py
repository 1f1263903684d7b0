"""Refuse config keys that the chosen job kind would silently ignore.

Why: a key that loads without error but does nothing is worse than a typo — the user believes that
evaluation runs every 50 steps, that four loader workers feed the run, or that the MoE balancer is
tuned, and nothing says otherwise. The strict loader already refuses unknown keys; this module
refuses known keys that have no effect in this run, with one line naming the dotted key and what to
use instead (`ConfigError`, exit 2 from launch/pretrain_vlm.py and `--check`).

- GRPO (`train.mode = "grpo"`) reads its batches from `[rl]` and its prompts without the packed SFT
  loader: `train.micro_batches_per_step`, `train.eval_every`, `train.eval_max_batches`,
  `train.eval_generate`, `data.num_workers`, `data.prefetch_factor`, `data.shuffle`,
  `data.length_cache_dir`, `data.loader_timeout_s` must keep their defaults (evaluation is `[rl.eval]`; batching is
  `rl.batch.prompts_per_step` / `rl.batch.mini_batches_per_step` / `data.max_tokens_per_pack`);
- SFT: an `[rl]` section is refused (it is only read by GRPO), and so are `train.eval_every` /
  `train.eval_max_batches` / `train.eval_generate` when there is no held-out split to evaluate (`data.eval_path`
  empty);
- the other modes: `data.loader_timeout_s` and `data.prefetch_factor` with `data.num_workers = 0` (no worker to wait
  for), and a timeout shorter than `data.video_decode_timeout_s` where workers run;
- every training mode: the `[data]` keys of another source kind — `train_path`, `eval_path`, `image_root`
  and `columns` with `data.type = "synthetic_vqa"` (it reads the set it generates), the `synthetic_*` keys with
  any other type, `columns` with any type but "hf";
- GRPO without a held-out split (`data.eval_path` empty): `rl.eval.every_steps` (the evaluation returns nothing;
  the other `[rl.eval]` keys shape it and may stay, as a config's own);
- PPO (`rl.advantage = "gae"`): `rl.critic.warmup_steps` >= `train.max_steps` (the policy would never move);
- GRPO with `[lora]`: `rl.update.ref_offload` (the reference is the policy without its adapters, no copy),
  and `rl.allocation` (the asynchronous weight push sends full weights, not adapters);
- asynchronous GRPO (`rl.allocation`) with fewer `rl.batch.prompts_per_step` than data-parallel training ranks
  (the training ranks / (parallel.tp x parallel.cp)): each shard trains on groups of its own, and one without
  a group would stop the job at its first step;
- evaluation (`train.mode = "eval"`, launch/evaluate.py) trains nothing and reads its files from
  `[eval]`: `[optimizer]`, `[scheduler]`, `[checkpoint]`, `[moe]`, `[logging]` (it writes result files, no
  metrics), `[rl]`, `[dpo]`, `[reward]`, `[[stages]]`, the `[train]`
  keys other than mode / output_dir / seed / precision, and the `[data]` keys that name or shape
  training data are refused; the `[data]` image / video limits, `max_tokens_per_pack` and loader
  workers apply to the benchmark prompts. An `[eval]` section in a training mode is refused too;
- a `data.max_tokens_per_pack` not divisible by 2 x `parallel.cp` (the load-balanced causal chunks);
  `parallel.cp` works in SFT and GRPO alike (GRPO: the ranks of a cp group generate the same samples,
  unsharded, and split the tokens of the packed training forwards);
- `[moe]` keys other than their defaults on a model without MoE layers (the bias-balancing keys on one whose routers
  have no score-correction bias, Qwen3-MoE's), and `[kernels]` backends forced for
  the MoE / Mamba2 ops on a model without such layers (`check_moe_section`, once the model — or its
  meta-device twin in `--check` — is built), `rl.routing_replay = "rollout"` on such a model too;
  `kernels.moe_ep_dispatch` without `parallel.ep` > 1;
- SFT with `[[stages]]`: a main-section key that every stage sets for itself (`train.max_steps` / `train.epochs`
  when every stage gives its length, `optimizer.lr`, `data.max_frames`, `data.train_path`, ...: `stages.STAGE_KEYS`),
  which no stage reads;
- DPO (`train.mode = "dpo"`): a `[dpo]` section in another mode, `[[stages]]`, `train.eval_generate`
  (DPO evaluates preference metrics, it does not generate), `parallel.cp` > 1, the `[dpo]` keys the chosen
  loss variant ignores (`training/dpo/config.py`) and `data.columns` without both "chosen" and "rejected"
  (or with "messages", "answer", "video", or with "chosen" / "rejected" reading the column of another of prompt /
  chosen / rejected); the "chosen" / "rejected" columns in another mode.
- reward-model training (`train.mode = "reward"`): the same pair-data rules as DPO (it reads the same
  pairs), a `[reward]` section in another mode, a `[dpo]` section, and what the mode does not run yet
  (`reward_refusal`, training/reward/config.py: tp / cp / pp / ep > 1, the mcore backend, `[lora]`, fp8).

A key counts as set when its value differs from the field's default (the loaded config does not
remember which keys the file spelled out; setting a default value explicitly is harmless).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Optional

from megatron_vlm.config.eval_section import MIN_PROMPT_TOKENS
from megatron_vlm.config.loader import ConfigError
from megatron_vlm.training.dpo.config import DPOConfig, check_dpo_keys
from megatron_vlm.training.reward.config import reward_refusal

if TYPE_CHECKING:
    from torch import nn

    from megatron_vlm.config import Config

__all__ = ["check_keys_for_mode", "check_moe_section", "changed_keys", "EVAL_DATA_IGNORED"]

_GRPO_IGNORED = {
    "train": {
        "micro_batches_per_step": "GRPO batches by rl.batch.prompts_per_step and rl.batch.mini_batches_per_step",
        "eval_every": "GRPO evaluates with [rl.eval] (rl.eval.every_steps)",
        "eval_max_batches": "GRPO evaluates with [rl.eval] (rl.eval.max_prompts)",
        "eval_generate": "GRPO evaluation always generates ([rl.eval])",
    },
    "data": {
        "num_workers": "GRPO reads its prompts in the training process (no loader workers)",
        "prefetch_factor": "GRPO reads its prompts in the training process (no loader workers)",
        "shuffle": "the GRPO prompt order is a function of train.seed and the step",
        "length_cache_dir": "GRPO does not pack by sample length",
        "loader_timeout_s": "GRPO reads its prompts in the training process (no loader workers to wait for)",
    },
}


_EVAL_TRAIN_KEYS = {"mode", "output_dir", "seed", "precision"}
# the [data] keys an evaluation refuses: its files and their image_root come from [[eval.benchmarks]]
EVAL_DATA_IGNORED = ("type", "train_path", "eval_path", "image_root", "columns", "shuffle", "synthetic_dir",
                     "synthetic_train_size", "synthetic_eval_size", "synthetic_seed", "synthetic_image_size")
_EVAL_IGNORED_SECTIONS = ("optimizer", "scheduler", "checkpoint", "moe", "logging")
_SYNTHETIC_IGNORED = ("train_path", "eval_path", "image_root", "columns")
_SYNTHETIC_ONLY = ("synthetic_dir", "synthetic_train_size", "synthetic_eval_size", "synthetic_seed",
                   "synthetic_image_size")


def _check_eval_keys(cfg: Config) -> None:
    why = "an evaluation job (train.mode = \"eval\") trains nothing"
    for key in changed_keys(cfg.train):
        if key not in _EVAL_TRAIN_KEYS:
            raise ConfigError(f"train.{key}: has no effect when {why}; remove it")
    for key in changed_keys(cfg.data):
        if key in EVAL_DATA_IGNORED:
            raise ConfigError(f"data.{key}: has no effect when train.mode = \"eval\" (benchmark files and their "
                              "image_root are given in [[eval.benchmarks]]); remove it")
    for name in _EVAL_IGNORED_SECTIONS:
        changed = changed_keys(getattr(cfg, name))
        if changed:
            raise ConfigError(f"{name}.{changed[0]}: has no effect when {why}; remove the [{name}] section")
    if cfg.rl is not None:
        raise ConfigError("rl: an [rl] section is only read when train.mode = \"grpo\"; the verifiers of an "
                          "evaluation are chosen per benchmark ([[eval.benchmarks]] verifier)")
    if cfg.stages:
        raise ConfigError("stages: [[stages]] chain SFT runs; an evaluation job has none")
    if cfg.parallel.pp > 1:  # _check_pipeline_keys is not reached for eval: the same refusal, named here
        raise ConfigError(f"parallel.pp: pipeline parallelism (pp = {cfg.parallel.pp}) is supported for train.mode = "
                          "\"sft\" only (no generation through a pipeline); use parallel.pp = 1")
    for name in ("dpo", "reward"):
        if getattr(cfg, name, None) is not None:
            raise ConfigError(f"{name}: the [{name}] section is only read when train.mode = \"{name}\"; {why} (its "
                              "results come from [eval] and the verifiers); remove it")
    new_tokens = cfg.eval.max_new_tokens if cfg.eval is not None else 0  # [eval] itself: required by the loader
    budget = cfg.data.max_tokens_per_pack - new_tokens
    if budget < MIN_PROMPT_TOKENS:  # found only at the first benchmark, after the model was built (a traceback)
        raise ConfigError(f"eval.max_new_tokens: {new_tokens} leaves {budget} tokens for a prompt within "
                          f"data.max_tokens_per_pack = {cfg.data.max_tokens_per_pack} (a prompt and its completion "
                          f"share it; at least {MIN_PROMPT_TOKENS}); raise data.max_tokens_per_pack or lower "
                          "eval.max_new_tokens")
    if getattr(cfg, "lora", None) is not None:
        raise ConfigError("lora: an evaluation job trains no adapter; evaluate a PEFT adapter with eval.adapter "
                          "(or a merged export as model.path)")


def changed_keys(section: Any) -> list[str]:
    """Fields of a dataclass section whose value differs from the field's default."""
    out = []
    for f in dataclasses.fields(section):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if getattr(section, f.name) != default:
            out.append(f.name)
    return out


def _check_pipeline_keys(cfg: Config) -> None:
    """parallel.pp > 1 runs SFT training steps only (parallel/pipeline.py): what it cannot run is refused."""
    pp = cfg.parallel.pp
    if pp <= 1:
        return
    if cfg.train.mode != "sft":
        raise ConfigError(f"parallel.pp: pipeline parallelism (pp = {pp}) is supported for train.mode = \"sft\" only "
                          "(no rollout through a pipeline); use parallel.pp = 1")
    if getattr(cfg, "stages", None):
        raise ConfigError(f"parallel.pp: pipeline parallelism (pp = {pp}) does not run [[stages]] curricula yet; "
                          "use parallel.pp = 1")
    d = cfg.data
    if d.eval_path or (d.type == "synthetic_vqa" and d.synthetic_eval_size > 0):
        raise ConfigError(f"parallel.pp: held-out evaluation does not run through a pipeline (pp = {pp}); set "
                          "data.eval_path = \"\" (synthetic data: data.synthetic_eval_size = 0)")
    if cfg.train.micro_batches_per_step < pp:  # the job's PipelineRunner refuses it too: found here by --check
        raise ConfigError(f"train.micro_batches_per_step: {cfg.train.micro_batches_per_step} is fewer than parallel.pp "
                          f"({pp}): the 1F1B schedule keeps every stage busy with a micro-batch of its own; set "
                          "train.micro_batches_per_step >= parallel.pp")
    if cfg.moe.aux_loss_coef > 0:
        raise ConfigError(f"parallel.pp: moe.aux_loss_coef ({cfg.moe.aux_loss_coef}) with pipeline parallelism "
                          f"(pp = {pp}) is not supported; set moe.aux_loss_coef = 0 (auxiliary-free balancing works)")


def _check_data_source_keys(cfg: Config) -> None:
    """The [data] keys of another source kind: `data.type = "synthetic_vqa"` writes and reads its own files
    (a `train_path` set on top of a demo config trained on the synthetic set without a word), only it reads the
    `synthetic_*` keys that shape that set, and only `type = "hf"` maps `columns`."""
    d = cfg.data
    if d.type == "synthetic_vqa":
        for key in _SYNTHETIC_IGNORED:
            if key in changed_keys(d):
                raise ConfigError(f"data.{key}: has no effect with data.type = 'synthetic_vqa' (the generated set in "
                                  "data.synthetic_dir is read); set data.type = 'messages_jsonl' or 'hf' to read your "
                                  "files")
    else:
        for key in _SYNTHETIC_ONLY:
            if key in changed_keys(d):
                raise ConfigError(f"data.{key}: only read with data.type = 'synthetic_vqa' (it shapes the generated "
                                  f"set), not {d.type!r}; remove it")
        if d.type != "hf" and d.columns:
            raise ConfigError(f"data.columns: only read with data.type = 'hf', not {d.type!r}; remove it or set "
                              "data.type = 'hf'")


def check_keys_for_mode(cfg: Config) -> None:
    """Raise ConfigError naming the first key that this job kind would ignore; with `[[stages]]`, also
    the first such key (or failed check) of each stage's own config, named as the stage key."""
    _check_keys(cfg)
    if getattr(cfg, "stages", None) and cfg.train.mode == "sft":
        from megatron_vlm.config.stage_configs import stage_configs

        _check_stage_shadowed_keys(cfg)
        stage_configs(cfg, check=_check_keys)


def _check_stage_shadowed_keys(cfg: Config) -> None:
    """A main-section key that every `[[stages]]` table sets for itself: each stage's config takes the stage's value
    (training/stages.py `stage_overrides`), so the main one is never read; a stage's length (`max_steps` or `epochs`)
    replaces both `train.max_steps` and `train.epochs`."""
    from megatron_vlm.training.stages import STAGE_KEYS

    stages = cfg.stages
    for dotted, key in STAGE_KEYS.items():
        section, name = dotted.split(".")
        if name not in changed_keys(getattr(cfg, section)):
            continue
        length = key in ("max_steps", "epochs")
        if all((s.max_steps is not None or s.epochs is not None) if length else getattr(s, key) is not None
               for s in stages):
            what = "length (max_steps or epochs)" if length else key
            raise ConfigError(f"{dotted}: every [[stages]] table sets its own {what}, so this value is never read; "
                              f"remove it, or set a stage's own (--set stages[0].{key}=...), or leave {key} out of "
                              "the stages that should take it")


def _check_loader_timeout(cfg: Config) -> None:
    """`data.loader_timeout_s` bounds the wait for a DataLoader worker's pack and `data.prefetch_factor` sets how many
    each worker prepares: without workers they are read by nothing; with them the timeout must outlast one video
    decode (a pack may hold several videos)."""
    data = cfg.data
    if data.num_workers == 0:
        for key in ("loader_timeout_s", "prefetch_factor"):
            if key in changed_keys(data):
                raise ConfigError(f"data.{key}: has no effect with data.num_workers = 0 (the training process reads the "
                                  "data itself, no worker to wait for or to prepare packs); remove it")
    elif 0 < data.loader_timeout_s < data.video_decode_timeout_s:
        raise ConfigError(f"data.loader_timeout_s: {data.loader_timeout_s} is shorter than video_decode_timeout_s "
                          f"{data.video_decode_timeout_s}; one slow video would stop the run instead of being skipped")


def _check_keys(cfg: Config) -> None:
    if cfg.train.mode != "grpo":
        _check_loader_timeout(cfg)
    if cfg.train.mode == "eval":
        _check_eval_keys(cfg)
        return
    if getattr(cfg, "eval", None) is not None:
        raise ConfigError(f"eval: the [eval] section is only read when train.mode = \"eval\" (launch/evaluate.py), "
                          f"not {cfg.train.mode!r}; SFT evaluates with train.eval_*, GRPO with [rl.eval]")
    _check_data_source_keys(cfg)
    if cfg.kernels.moe_ep_dispatch != "auto" and cfg.parallel.ep == 1:
        raise ConfigError("kernels.moe_ep_dispatch: only runs with expert parallelism (parallel.ep > 1); remove it")
    cp = cfg.parallel.cp
    if cp > 1 and cfg.data.max_tokens_per_pack % (2 * cp):
        raise ConfigError(f"parallel.cp: data.max_tokens_per_pack ({cfg.data.max_tokens_per_pack}) must be divisible by "
                          f"2 x parallel.cp ({2 * cp}): each pack is cut into 2 x cp load-balanced chunks")
    _check_pipeline_keys(cfg)
    if (cfg.parallel.backend == "mcore" and cfg.train.mode == "grpo" and cfg.rl is not None
            and cfg.rl.allocation is not None):
        raise ConfigError("rl.allocation: asynchronous GRPO pushes the trainer's parameters by name and does not "
                          "support parallel.backend = 'mcore' yet; remove rl.allocation or use backend = 'native'")
    _check_dpo_mode(cfg)
    if cfg.train.mode == "grpo":
        if getattr(cfg, "lora", None) is not None and cfg.rl is not None and cfg.rl.update.ref_offload:
            raise ConfigError("rl.update.ref_offload: has no effect with [lora] (the reference is the policy without its "
                              "adapters, no separate copy to offload); remove it")
        if getattr(cfg, "lora", None) is not None and cfg.rl is not None and cfg.rl.allocation is not None:
            raise ConfigError("rl.allocation: asynchronous GRPO pushes full weights to the rollout ranks and does not "
                              "support [lora] yet; remove rl.allocation or the [lora] section")
        if cfg.rl is not None and cfg.rl.allocation is not None:
            _check_async_shards(cfg)
        warmup = cfg.rl.critic_warmup_refusal(cfg.train.max_steps) if cfg.rl is not None else None
        if warmup:
            raise ConfigError(warmup)
        no_split = _no_eval_split(cfg)
        if no_split and cfg.rl is not None and cfg.rl.eval.every_steps:  # the evaluation would return nothing
            raise ConfigError(f"rl.eval.every_steps: there is no held-out split to evaluate ({no_split}); set it to 0")
        for name, why in _GRPO_IGNORED.items():
            section = getattr(cfg, name)
            for key in changed_keys(section):
                if key in why:
                    raise ConfigError(f"{name}.{key}: has no effect when train.mode = \"grpo\" ({why[key]}); remove it")
        return
    if cfg.rl is not None:
        raise ConfigError("rl: an [rl] section is only read when train.mode = \"grpo\"; remove it or set train.mode")
    stages = getattr(cfg, "stages", None) or []
    stage_eval = bool(stages) and all(s.eval_path for s in stages)  # every stage brings its held-out split
    no_split = _no_eval_split(cfg, stage_eval)
    if no_split:
        for key in ("eval_every", "eval_max_batches", "eval_generate"):
            if key in changed_keys(cfg.train):
                raise ConfigError(f"train.{key}: there is no held-out split to evaluate ({no_split})")


def _check_async_shards(cfg: Config) -> None:
    """Asynchronous GRPO deals a step's groups over the data shards of its training ranks (rl/asynchronous/trainer.py):
    a shard without a group only forwards a dummy (loss x 0), which prompts skipped mid-run may cause for one step;
    fewer prompts per step than shards would idle a shard at every step, so that is refused here, before any rank
    starts."""
    from megatron_vlm.rl.asynchronous.allocation import parse_allocation

    rl, p = cfg.rl, cfg.parallel
    assert rl is not None and rl.allocation is not None
    train, per_shard = parse_allocation(rl.allocation).train, p.tp * p.cp
    shards = train // per_shard if train % per_shard == 0 else 0  # a layout that does not divide: the layout check's
    if shards and rl.batch.prompts_per_step < shards:
        raise ConfigError(f"rl.batch.prompts_per_step: {rl.batch.prompts_per_step} prompts per step for {shards} "
                          f"data-parallel training ranks (rl.allocation = {rl.allocation!r}, parallel.tp x parallel.cp = "
                          f"{per_shard}): asynchronous GRPO trains each on groups of its own; set it to >= {shards}")


def _no_eval_split(cfg: Config, stage_eval: bool = False) -> str:
    """Why the run has no held-out split ("" when it has one); `stage_eval`: every [[stages]] table brings one.

    The synthetic set counts as having one: `data.synthetic_eval_size = 0` is the switch that turns its
    evaluation off (the pipeline refusal asks for it), so the cadence keys of a demo config may stay."""
    if cfg.data.type == "synthetic_vqa":
        return ""
    return "data.eval_path is empty" if not cfg.data.eval_path and not stage_eval else ""


_DPO_COLUMNS = {"prompt", "chosen", "rejected", "image", "images", "system"}


def _check_dpo_mode(cfg: Config) -> None:
    """The keys a DPO / reward-model run ignores, and their keys another mode ignores (module docstring)."""
    mode = cfg.train.mode
    dpo_mode = mode == "dpo"
    columns = set(cfg.data.columns) if cfg.data.type == "hf" else set()
    if mode != "reward" and getattr(cfg, "reward", None) is not None:
        raise ConfigError(f"reward: the [reward] section is only read when train.mode = \"reward\", not {mode!r}; "
                          "remove it or set train.mode")
    if not dpo_mode:
        if getattr(cfg, "dpo", None) is not None:
            raise ConfigError(f"dpo: the [dpo] section is only read when train.mode = \"dpo\", not {mode!r}; "
                              "remove it or set train.mode")
        if columns & {"chosen", "rejected"} and mode != "reward":
            key = sorted(columns & {"chosen", "rejected"})[0]
            raise ConfigError(f"data.columns.{key}: preference columns are only read when train.mode = \"dpo\" or "
                              "\"reward\"")
        if mode != "reward":
            return
        refused = reward_refusal(cfg)
        if refused:
            raise ConfigError(refused)
    if cfg.stages:
        raise ConfigError(f"stages: [[stages]] chain SFT runs; train.mode = {mode!r} runs one stage")
    if not cfg.train.eval_generate:
        raise ConfigError(f"train.eval_generate: has no effect when train.mode = {mode!r} (it evaluates preference "
                          "metrics on the held-out pairs, it does not generate); remove it")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp: context parallelism (cp = {cfg.parallel.cp}) is not supported with "
                          f"train.mode = {mode!r} yet; use parallel.cp = 1")
    if cfg.data.type == "hf":
        extra = sorted(columns - _DPO_COLUMNS)
        if extra:
            raise ConfigError(f"data.columns.{extra[0]}: not a preference column; train.mode = {mode!r} reads "
                              f"{sorted(_DPO_COLUMNS)} (chosen and rejected required)")
        if not {"chosen", "rejected"} <= columns:
            raise ConfigError(f"data.columns: train.mode = {mode!r} needs both 'chosen' and 'rejected', got {sorted(columns)}")
        mapped = cfg.data.columns
        for key in ("chosen", "rejected"):  # every pair would be identical, or its response the prompt
            other = next((k for k in ("prompt", "chosen") if k != key and mapped.get(k) == mapped[key]), None)
            if other is not None:
                raise ConfigError(f"data.columns.{key}: reads column {mapped[key]!r}, as data.columns.{other} does; "
                                  "map each to its own column")
    if dpo_mode:  # the section's defaults when it is absent (its reference among them)
        check_dpo_keys(getattr(cfg, "dpo", None) or DPOConfig(), getattr(cfg, "lora", None))


_LAYER_KERNELS = {
    "Mamba2": ("causal_conv1d", "ssd_chunk_scan", "ssd_state_update"),
    "MoE": ("moe_permute", "grouped_mm", "moe_unpermute", "moe_topk_gating", "moe_ep_dispatch"),
}
"""The [kernels] ops only one kind of layer runs: a backend forced for them on a model without such layers
would never be used."""


def check_moe_section(cfg: Config, model: nn.Module, layer_kinds: Optional[Collection[str]] = None) -> None:
    """Raise ConfigError when `[moe]` (or GRPO's `rl.routing_replay`) sets anything and `model` has no MoE layers, or
    `[kernels]` forces a backend for an op of a layer kind (`_LAYER_KERNELS`: MoE, Mamba2) the model does not have. `layer_kinds`: the kinds the
    whole model has, when `model` is one pipeline stage of it (`ModelBundle.layer_kinds`; a stage may hold none of
    the model's MoE or Mamba2 layers); None: read from `model`."""
    from megatron_vlm.models.common.mamba2 import Mamba2Mixer
    from megatron_vlm.models.common.moe import moe_layers
    from megatron_vlm.training.moe_balancing import MOE_BIAS

    if layer_kinds is None:
        has = {"MoE": bool(list(moe_layers(model))), "Mamba2": any(isinstance(m, Mamba2Mixer) for m in model.modules())}
    else:
        has = {kind: kind in layer_kinds for kind in _LAYER_KERNELS}
    changed = changed_keys(cfg.moe)
    if changed and not has["MoE"]:
        raise ConfigError(f"moe.{changed[0]}: the model ({type(model).__name__}) has no MoE layers; remove the [moe] section")
    bias_keys = [k for k in ("enable_moe_load_balancing_training", "bias_update_rate") if k in changed]
    if bias_keys and not (MOE_BIAS in layer_kinds if layer_kinds is not None else any(
            layer.gate.e_score_correction_bias is not None for layer in moe_layers(model))):  # what balancing moves
        raise ConfigError(f"moe.{bias_keys[0]}: the model's MoE routers ({type(model).__name__}) have no score-correction "
                          "bias, so there is nothing to balance; remove the key")
    rl = getattr(cfg, "rl", None)
    if rl is not None and cfg.train.mode == "grpo" and rl.routing_replay == "rollout" and not has["MoE"]:
        raise ConfigError(f"rl.routing_replay: 'rollout' replays the rollout's MoE routes; the model "
                          f"({type(model).__name__}) has no MoE layers, so nothing would be replayed; remove it")
    forced = set(changed_keys(cfg.kernels))
    for kind, ops in _LAYER_KERNELS.items():
        for op in ops:
            if op in forced and not has[kind]:
                raise ConfigError(f"kernels.{op}: the model ({type(model).__name__}) has no {kind} layers, so this op "
                                  "never runs; remove the key")
