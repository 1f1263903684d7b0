"""The GRPO job kind behind `[train] mode = "grpo"`: its parts and its step object for the training
loop (`training/loop.py`).

`build_grpo_parts(ctx, bundle)`: the prompt sets from `[data]`, the prompt encoder, the built-in
rollout engine on the policy itself, the reward manager (worker processes with time limits) and —
only when `rl.loss.kl_coef > 0` — the frozen reference policy. `GRPOLoopStep` is what the loop runs per
step: the step's prompts (a function of (seed, step), so a resumed run repeats the uninterrupted
one), one `GRPOStep` (rl/grpo_step.py: rollout, rewards, advantages, log-probs, updates, metrics),
the held-out evaluation it is given (Avg@k, `megatron_vlm.eval.grpo_accuracy`), and the data state
of a checkpoint (next step, seed, prompt count, the running totals and this rank's skipped prompts:
a prompt the encoder refuses when a step draws it is a bad record found mid-run, which a resumed run
would not find again for the steps before its checkpoint).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_vlm.data.bad_records import BadRecordLog, keep_planning_records
from megatron_vlm.data.data_files import content_signatures
from megatron_vlm.data.media import MediaLimits
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutEngine
from megatron_vlm.inference.kv_budget import kv_bytes_per_slot, rollout_prompts_for_budget
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.parallel_plan import copy_input_casts
from megatron_vlm.parallel.collectives import all_reduce_max, barrier
from megatron_vlm.parallel.master_weights import master_weights_of
from megatron_vlm.parallel.precision import compute_dtype, mixed_param_dtype
from megatron_vlm.rl.asynchronous.bridge import current_role
from megatron_vlm.rl.config import RLConfig
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.prompts.data_state import (
    grpo_data_state,
    grpo_data_state_refusal,
    warn_unrecorded_prompt_lengths,
)
from megatron_vlm.rl.prompts.dataset import prompt_batches
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.lengths import drop_unusable_prompts
from megatron_vlm.rl.prompts.sets import PromptSets, load_prompt_sets
from megatron_vlm.rl.prompts.shard import PromptEncoding
from megatron_vlm.rl.reference import BaseModelReference, ReferencePolicy
from megatron_vlm.rl.rewards.combined import CombinedRewards, has_model_rewards
from megatron_vlm.rl.rewards.failure_watch import RewardsAllFailedError
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.training.bad_record_summary import restore_saved_bad_records, save_bad_records, write_bad_record_summary
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.loop import StopAfterStep
from megatron_vlm.training.model_bundle import ModelBundle
from megatron_vlm.training.running_totals import RunningTotals
from megatron_vlm.training.sft import moe_report_state, restore_moe_report
from megatron_vlm.training.signals import StepAbandoned

__all__ = ["check_model_folder", "check_grpo_config", "require_rl", "grpo_total_steps", "rollout_batch_prompts", "build_rollout_engine", "GRPOParts",
           "build_grpo_parts", "GRPOLoopStep"]

log = logging.getLogger("megatron_vlm")


def check_model_folder(cfg) -> None:
    """A GRPO run starts from an existing model folder; say how to make it when it is missing."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file() or cfg.model.synthesize is not None:
        return
    hint = cfg.rl.model_path_hint if cfg.rl is not None else None
    msg = f"model.path: {path} has no config.json"
    raise FileNotFoundError(f"{msg}; {hint}" if hint else f"{msg} (GRPO starts from a trained model folder)")


def require_rl(cfg) -> RLConfig:
    """The run's [rl] section; a GRPO run without one is a config error, not an attribute error deep in a rank."""
    if cfg.rl is None:
        raise ConfigError("rl: train.mode = 'grpo' needs an [rl] section")
    return cfg.rl


def check_grpo_config(cfg) -> None:
    require_rl(cfg)
    check_model_folder(cfg)


def grpo_total_steps(train_cfg, rl, num_prompts: int) -> int:
    """`train.max_steps`, else `train.epochs` passes over the train prompts: ceil(epochs x prompts /
    rl.batch.prompts_per_step) steps (at least 1)."""
    if train_cfg.max_steps is not None:
        return train_cfg.max_steps
    if num_prompts <= 0:
        raise ConfigError("data.train_path: no training prompts to derive the steps of train.epochs from")
    return max(1, math.ceil(train_cfg.epochs * num_prompts / rl.batch.prompts_per_step))


def rollout_batch_prompts(rl, model, *, max_tokens_per_pack: int, bytes_per_element: int) -> int:
    """Prompts generated together on one rank: `rl.rollout.batch_prompts` when set, else as many as
    `rl.rollout.memory_gib` of KV cache holds (0 = no budget: all of the rank's prompts)."""
    if rl.rollout.batch_prompts:
        return rl.rollout.batch_prompts
    return rollout_prompts_for_budget(rl.rollout.memory_gib, kv_bytes_per_slot(model, bytes_per_element),
                                      rl.batch.group_size, max_tokens_per_pack)


def paged_kv_kwargs(rl) -> dict:
    """The engine's paged-KV-cache arguments from `[rl]` (every engine of a GRPO job: the synchronous
    trainer's, which also runs [rl.eval], and the asynchronous rollout ranks')."""
    return {"kv_block_size": rl.rollout.kv_block_size, "kv_cache_blocks": rl.rollout.kv_cache_blocks}


def build_rollout_engine(rl, bundle: ModelBundle, model_path: str, *, dtype: torch.dtype, device: torch.device,
                         per_batch: int, param_dtype: Optional[torch.dtype] = None) -> PolicyRolloutEngine:
    """`rl.rollout.weights = "shared"`: the engine calls the trainer's model through the FSDP root, ranks in
    lock-step. "copy": an unsharded copy of the policy on this rank (read from the model folder, with the
    trainer's LoRA adapters if it has any, then refreshed from the trainer's weights at every `load_weights`), continuous batching with
    per_batch * group_size slots (0: all of the step's samples). `param_dtype`: the trainer's mixed-precision dtype
    (`mixed_param_dtype`; None: full precision), whose input casts a copy makes too (`copy_input_casts`)."""
    if rl.rollout.weights == "copy":
        from megatron_vlm.checkpoint.hf import load_hf_model
        from megatron_vlm.models.common.lora import mirror_lora

        policy_copy = load_hf_model(model_path, dtype=dtype, device=device).eval()
        if bundle.model is not None:  # [lora]: the copy holds the same adapters, refreshed with the rest
            mirror_lora(policy_copy, bundle.model)
        policy_copy.requires_grad_(False)
        copy_input_casts(policy_copy, param_dtype)  # computes what the trainer's forward computes
        # CudaGraphsConfigError (exit 2): "on" with a decode step that cannot be captured (a paged cache);
        # PagedKVConfigError (exit 2): rl.rollout.kv_block_size with a Mamba2 hybrid decoder
        return PolicyRolloutEngine(policy_copy, bundle.processor.tokenizer,
                                   EngineOptions(cache_dtype=dtype, device=device,
                                                 max_num_seqs=per_batch * rl.batch.group_size,
                                                 cuda_graphs=rl.rollout.cuda_graphs, record_routes=True, **paged_kv_kwargs(rl)),
                                   sync_from=bundle.model)
    if rl.rollout.weights == "expert_parallel":  # dense weights whole, this rank's experts (inference/ep_rollout.py)
        return build_ep_rollout_engine(rl, bundle, model_path, dtype=dtype, device=device, per_batch=per_batch,
                                       param_dtype=param_dtype)
    if master_weights_of(bundle.wrapper) is not None:
        # parallel.fsdp = false: the trainer's weights are already a bf16 inference copy on this process (no FSDP
        # root to call, no gather, no other rank), updated in place by each optimizer step: the engine decodes with
        # them as with its own copy (continuous batching, CUDA graphs, which keep reading the same tensors) and
        # nothing is copied. Its q / k / v stay unfused: the optimizer holds those Parameters.
        log.info("rollout: the engine decodes with the trainer's bf16 weights in place (parallel.fsdp = false; "
                 "continuous batching, nothing gathered or copied)")
        return PolicyRolloutEngine(bundle.model, bundle.processor.tokenizer,
                                   EngineOptions(cache_dtype=dtype, device=device,
                                                 max_num_seqs=per_batch * rl.batch.group_size,
                                                 cuda_graphs=rl.rollout.cuda_graphs, record_routes=True,
                                                 fuse_projections=False, **paged_kv_kwargs(rl)))
    return PolicyRolloutEngine(bundle.model, bundle.processor.tokenizer,
                               EngineOptions(cache_dtype=dtype, device=device, max_prompts_per_batch=per_batch,
                                             cuda_graphs=rl.rollout.cuda_graphs, record_routes=True, **paged_kv_kwargs(rl)),
                               forward=lambda **kw: bundle.wrapper(model_kwargs=kw),
                               all_ranks_active=lambda flags: all_reduce_max([int(flags)], device)[0])


def build_ep_rollout_engine(rl, bundle: ModelBundle, model_path: str, *, dtype: torch.dtype, device: torch.device,
                            per_batch: int, param_dtype: Optional[torch.dtype] = None) -> PolicyRolloutEngine:
    """`rl.rollout.weights = "expert_parallel"`: the rollout copy holds the dense weights unsharded and this rank's
    experts of the trainer's ep layout; lock-step batches of per_batch prompts (the MoE all-to-alls), refreshed from
    the trainer at every `load_weights`."""
    from megatron_vlm.inference.ep_rollout import ExpertParallelRolloutEngine, build_ep_rollout_copy, expert_parallel_group

    group = expert_parallel_group(bundle.model)
    if group is None:
        raise ConfigError("rl.rollout.weights: 'expert_parallel' needs the trainer's experts sharded (parallel.ep > 1 "
                          "with the native backend); this run's model has none")
    policy_copy = build_ep_rollout_copy(bundle.model, model_path, dtype=dtype, device=device, ep_group=group)
    copy_input_casts(policy_copy, param_dtype)
    return ExpertParallelRolloutEngine(policy_copy, bundle.processor.tokenizer,
                                       EngineOptions(cache_dtype=dtype, device=device, max_prompts_per_batch=per_batch,
                                                     cuda_graphs=rl.rollout.cuda_graphs, record_routes=True,
                                                     **paged_kv_kwargs(rl)),
                                       trainer=bundle.model,
                                       all_ranks_active=lambda flags: all_reduce_max([int(flags)], device)[0])


@dataclass
class GRPOParts:
    sets: PromptSets
    encoder: PromptEncoding
    engine: RolloutEngine
    manager: Union[RewardManager, CombinedRewards]
    """Owns worker processes: `close()` it at the end of the run. With reward models / judges in
    `[[rl.rewards]]` a `CombinedRewards` (rl/rewards/combined.py) holding them and the rule rewards' manager."""
    reference: Optional[Union[ReferencePolicy, BaseModelReference]] = None
    bad_records: Optional[BadRecordLog] = None
    """Prompts left out by the reader and the encoder (saved with each checkpoint, written to bad_records.json
    with it and at the end). Those left out at start-up are kept on global rank 0 only: every rank finds them."""
    multiturn: Any = None
    """[rl.env]: the multi-turn rollout (rl/env/rollout.py `MultiTurnRounds`; owns worker processes: `close()` it)."""


def build_grpo_parts(ctx: RunContext, bundle: ModelBundle) -> GRPOParts:
    cfg, env, rl = ctx.cfg, ctx.env, require_rl(ctx.cfg)
    bad_records, found = BadRecordLog(), BadRecordLog()
    sets = load_prompt_sets(cfg.data, rl, run_dir=ctx.run_dir, is_main=env.is_main, barrier=barrier, bad_records=found)
    # over-long / unreadable prompts out before the first step (exit 2 when none is left), as the rollout ranks do
    # a synchronous job's ranks all come here together: each estimates a share of the prompts (an all-gather); the
    # asynchronous trainer ranks do not share a collective with the rollout ranks here, so each runs the whole pass
    sets = drop_unusable_prompts(sets, bundle.processor, cfg.data, rl, found, split_over_ranks=current_role() is None)
    keep_planning_records(found, bad_records)  # every rank reads the same prompts: counted once, not once per rank
    log.info("GRPO prompts: %d train, %s held-out", len(sets.train), len(sets.eval) if sets.eval else "no")
    dtype = compute_dtype(cfg.train.precision, getattr(torch, cfg.model.dtype), env.device)
    param_dtype = mixed_param_dtype(cfg.train.precision, env.device)  # the trainer's casts, made by its copies too
    budget = max(rl.rollout.max_new_tokens, rl.eval.max_new_tokens or 0)
    per_batch = rollout_batch_prompts(rl, bundle.model, max_tokens_per_pack=cfg.data.max_tokens_per_pack,
                                      bytes_per_element=torch.finfo(dtype).bits // 8)
    if per_batch and not rl.rollout.batch_prompts:
        log.info("rollout: %d prompts per batch (rl.rollout.memory_gib = %g GiB of KV cache)", per_batch, rl.rollout.memory_gib)
    encoder = PromptEncoder(bundle.processor, max_frames=cfg.data.max_frames, fps=cfg.data.fps, max_new_tokens=budget,
                            max_tokens=cfg.data.max_tokens_per_pack, limits=MediaLimits.from_config(cfg.data),
                            bad_records=bad_records)
    engine: RolloutEngine
    if rl.rollout_backend == "vllm":  # the vLLM back end (inference/vllm_engine.py): its own weights, fed after each step
        from megatron_vlm.inference.vllm_engine import vllm_engine_for_run

        engine = vllm_engine_for_run(ctx, bundle, dtype=dtype)
    else:
        engine = build_rollout_engine(rl, bundle, cfg.model.path, dtype=dtype, device=env.device, per_batch=per_batch,
                                      param_dtype=param_dtype)
    reference: Optional[Union[ReferencePolicy, BaseModelReference]] = None
    if rl.loss.kl_coef > 0 and getattr(cfg, "lora", None) is not None:  # base = the policy without its adapters: no second copy
        reference = BaseModelReference(bundle.wrapper, bundle.model, temperature=rl.rollout.temperature)
    elif rl.loss.kl_coef > 0:
        reference = ReferencePolicy.from_pretrained(cfg.model.path, dtype=dtype, device=env.device,
                                                    offload=rl.update.ref_offload, temperature=rl.rollout.temperature,
                                                    param_dtype=param_dtype)
    pool: dict[str, Any] = dict(timeout_s=rl.reward_pool.timeout_s, num_workers=rl.reward_pool.workers,
                                memory_limit_mb=rl.reward_pool.memory_limit_mb,
                                batch_timeout_s=rl.reward_pool.batch_timeout_s, value_limit=rl.reward_pool.abs_max)
    manager: Union[RewardManager, CombinedRewards]
    if has_model_rewards(rl.rewards):  # reward models / judges: loaded here, one copy per rank, scored in-process
        manager = CombinedRewards(rl.rewards, pool=pool, dtype=dtype, device=env.device, max_frames=cfg.data.max_frames,
                                  fps=cfg.data.fps, limits=MediaLimits.from_config(cfg.data))
    else:
        manager = RewardManager(rl.rewards, **pool)
    multiturn = None
    prompt_encoder: PromptEncoding = encoder
    if rl.env is not None:  # multi-turn rollouts: environments in worker processes, tools in the system turn
        from megatron_vlm.rl.env.rollout import MultiTurnRounds

        multiturn = MultiTurnRounds.from_config(rl, cfg.data.max_tokens_per_pack, engine, bundle.processor, data=cfg.data)
        prompt_encoder = multiturn.prompt_encoder(encoder)
    return GRPOParts(sets=sets, encoder=prompt_encoder, engine=engine, manager=manager, reference=reference,
                     bad_records=bad_records, multiturn=multiturn)


def has_moe_report(metrics: dict) -> bool:
    """The step's metrics hold a MoE workload report (moe.n_step_per_workload_report): the step logs its row even
    outside train.log_every, as the SFT and pair trainers do, or the report's moe/* metrics would be lost."""
    return any(k.startswith(("moe/", "critic/moe/")) for k in metrics)


class GRPOLoopStep:
    """The loop's step object of a GRPO run (`training.loop.StepRunner`)."""

    def __init__(self, ctx: RunContext, train_set: Any, grpo: GRPOStep,
                 evaluate: Optional[Callable[[int], Optional[dict]]] = None, bad_records: Optional[BadRecordLog] = None):
        self.ctx, self.bad_records = ctx, bad_records
        self.rl, self.seed = require_rl(ctx.cfg), ctx.cfg.train.seed
        self.train_set, self.grpo, self._evaluate = train_set, grpo, evaluate
        self._batches: Optional[Iterator[list[int]]] = None
        self.totals = RunningTotals()
        """reward/calls, data/skipped_prompts, ...: counted on from the checkpoint's totals after a resume."""
        files = [Path(f) for f in getattr(train_set, "files", ())]
        self._files = content_signatures(files) if files else None
        self._lengths = getattr(train_set, "start_lengths", None)
        """The train prompts' lengths measured at start-up (`PromptLengths`; None: not measured)."""

    def check_data_state(self, state: dict) -> None:
        """ConfigError (exit 2, naming the key) when this run would not continue the checkpoint's prompt order; one
        warning when the checkpoint predates the prompt-lengths digest."""
        refusal = grpo_data_state_refusal(state, **self._order(), data_files=self._data_files(),
                                          prompt_lengths=self._prompt_lengths())
        if refusal:  # another prompt set / seed / step size: exit 2 naming the key (rl/prompts/data_state.py)
            raise ConfigError(refusal)
        if self._lengths is not None and "prompt_lengths" not in state:
            warn_unrecorded_prompt_lengths()

    def load_data_state(self, state: dict, step: int) -> None:  # noqa: ARG002 (the order is a function of the step)
        """The checkpoint's prompt order checked, its running totals and the prompts skipped before it restored (the
        steps before the checkpoint are not drawn again; those this run left out at start-up again count once)."""
        self.check_data_state(state)
        shards = self.grpo.shards
        restore_saved_bad_records(self.bad_records, state, same_split=state.get("dp_size") == shards.world,
                                  is_main=self.ctx.env.is_main)
        self.totals.restore(state)
        restore_moe_report(self._balancer(), state)
        restore_moe_report(self._balancer(critic=True), state, "critic_moe_report")

    def _balancer(self, critic: bool = False) -> Any:
        """The policy's MoE balancer, or the critic's (None: no MoE layers, no critic)."""
        policy = self.grpo.policy
        if critic:
            return getattr(policy.critic, "balancer", None)
        return getattr(policy.bundle, "moe_balancer", None)

    def data_state(self, step: int) -> dict:
        """The prompt order, the running totals and this rank's skipped prompts; also writes bad_records.json
        (collective: every rank saves), so a run killed later leaves the summary of everything up to its checkpoint."""
        shards = self.grpo.shards
        state = {**grpo_data_state(step, **self._order(), data_files=self._data_files(),
                                   prompt_lengths=self._prompt_lengths()), **self.totals.state(),
                 "dp_size": shards.world,
                 **moe_report_state(self._balancer()), **moe_report_state(self._balancer(critic=True), "critic_moe_report")}
        return save_bad_records(state, self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                dp_rank=shards.rank)

    def _data_files(self) -> Optional[dict]:
        """The train prompt files' `content_signatures` (read when the step object is made, as the prompts were
        read at start-up), None for prompts without files."""
        return self._files

    def _prompt_lengths(self) -> Optional[dict]:
        """The train prompts' length record (`PromptLengths.state()`), None when they were not measured."""
        return self._lengths.state() if self._lengths is not None else None

    def _order(self) -> dict:
        """What the prompt order is a function of (with the step)."""
        return {"seed": self.seed, "num_prompts": len(self.train_set), "prompts_per_step": self.rl.batch.prompts_per_step}

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        if self._batches is None:
            self._batches = prompt_batches(len(self.train_set), self.rl.batch.prompts_per_step, seed=self.seed, start_step=step)
        batch = [self.train_set[i] for i in next(self._batches)]
        with self.abandonable(), self.stop_after_step(step):
            metrics = self.grpo.run(step, batch, prompt_pool=self.train_set)
        return self._finish_step(step, metrics, log)

    def _finish_step(self, step: int, metrics: dict[str, float], log: bool) -> dict[str, float]:
        metrics.update(getattr(self.grpo.engine, "metrics", dict)())  # the vLLM back end's rollout/weight_push_s
        metrics["epoch"] = (step + 1) * self.rl.batch.prompts_per_step / len(self.train_set)
        self.totals.add_to(metrics)  # every step (the metrics are reduced every step): the next checkpoint's totals
        return metrics if log or has_moe_report(metrics) else {}

    @contextmanager
    def stop_after_step(self, step: int) -> Iterator[None]:
        """A step that ran but had no usable reward for the last rl.reward_pool.max_failed_steps steps: its metrics
        finished as any step's (they go into the checkpoint's totals), then `StopAfterStep` (the loop saves what
        would be lost and the run exits 1)."""
        try:
            yield
        except RewardsAllFailedError as e:
            raise StopAfterStep(e, self._finish_step(step, dict(e.metrics or {}), True), wasted=e.streak) from None

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """Around the part of a step that may be abandoned (`StepAbandoned`: a stop while a wait hung): the step's
        prompts are drawn again by the next `train_step` and the prompts its encoder skipped are forgotten (the redone
        step skips and records them again; kept, they would count twice in the checkpoint saved at its start)."""
        found = self.bad_records.to_dict()["records"] if self.bad_records is not None else []
        try:
            yield
        except StepAbandoned:
            self._batches = None
            if self.bad_records is not None:
                self.bad_records.take()
                self.bad_records.extend(found)
            raise

    def evaluate(self, step: int) -> Optional[dict]:
        return self._evaluate(step) if self._evaluate is not None else None

    def finish(self) -> None:
        """The run's bad_records.json (prompts left out; the tp / cp ranks of a data shard skip the same ones: counted
        once); the reward workers belong to `GRPOParts` (closed by its owner)."""
        write_bad_record_summary(self.bad_records, self.ctx.run_dir, is_main=self.ctx.env.is_main,
                                 dp_rank=self.grpo.shards.rank)
