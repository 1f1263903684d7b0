"""The GRPO job kind behind `[train] mode = "grpo"`: its parts and its step object for the training
loop (`training/loop.py`).

`build_grpo_parts(ctx, bundle)`: the prompt sets from `[data]`, the prompt encoder, the built-in
rollout engine on the policy itself, the reward manager (worker processes with time limits) and —
only when `rl.kl_coef > 0` — the frozen reference policy. `GRPOLoopStep` is what the loop runs per
step: the step's prompts (a function of (seed, step), so a resumed run repeats the uninterrupted
one), one `GRPOStep` (rl/grpo_step.py: rollout, rewards, advantages, log-probs, updates, metrics),
the held-out evaluation it is given (Avg@k, `megatron_vlm.eval.grpo_accuracy`), and the data state
of a checkpoint (next step, seed, prompt count).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_vlm.parallel.collectives import any_rank, barrier
from megatron_vlm.parallel.precision import compute_dtype
from megatron_vlm.rl.data import prompt_batches
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.prompts import PromptEncoder, PromptSets, load_prompt_sets
from megatron_vlm.rl.reference import ReferencePolicy
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.rollout import PolicyRolloutEngine
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["check_model_folder", "check_grpo_config", "GRPOParts", "build_grpo_parts", "GRPOLoopStep"]

log = logging.getLogger("megatron_vlm")


def check_model_folder(cfg) -> None:
    """A GRPO run starts from an existing model folder; say how to make it when it is missing."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file() or cfg.model.synthesize is not None:
        return
    hint = cfg.rl.model_path_hint if cfg.rl is not None else None
    msg = f"model.path: {path} has no config.json"
    raise FileNotFoundError(f"{msg}; {hint}" if hint else f"{msg} (GRPO starts from a trained model folder)")


def check_grpo_config(cfg) -> None:
    if cfg.rl is None:
        raise ValueError("rl: train.mode = 'grpo' needs an [rl] section")
    if cfg.train.max_steps is None:
        raise ValueError("train.max_steps: GRPO runs a fixed number of steps; set train.max_steps (train.epochs is not used)")
    check_model_folder(cfg)


@dataclass
class GRPOParts:
    sets: PromptSets
    encoder: PromptEncoder
    engine: PolicyRolloutEngine
    manager: RewardManager
    """Owns worker processes: `close()` it at the end of the run."""
    reference: Optional[ReferencePolicy] = None


def build_grpo_parts(ctx: RunContext, bundle: ModelBundle) -> GRPOParts:
    cfg, env, rl = ctx.cfg, ctx.env, ctx.cfg.rl
    sets = load_prompt_sets(cfg.data, rl, run_dir=ctx.run_dir, is_main=env.is_main, barrier=barrier)
    log.info("GRPO prompts: %d train, %s held-out", len(sets.train), len(sets.eval) if sets.eval else "no")
    dtype = compute_dtype(cfg.train.precision, getattr(torch, cfg.model.dtype), env.device)
    budget = max(rl.max_new_tokens, rl.eval.max_new_tokens or 0)
    encoder = PromptEncoder(bundle.processor, max_frames=cfg.data.max_frames, fps=cfg.data.fps, max_new_tokens=budget,
                            max_tokens=cfg.data.max_tokens_per_pack)
    engine = PolicyRolloutEngine(
        bundle.model, bundle.processor.tokenizer, forward=lambda **kw: bundle.wrapper(model_kwargs=kw), cache_dtype=dtype,
        device=env.device, max_prompts_per_batch=rl.rollout_batch_prompts,
        all_ranks_active=lambda active: any_rank(active, env.device),
    )
    reference = None
    if rl.kl_coef > 0:
        reference = ReferencePolicy.from_pretrained(cfg.model.path, dtype=dtype, device=env.device,
                                                    offload=rl.ref_offload, temperature=rl.temperature)
    manager = RewardManager(rl.rewards, timeout_s=rl.reward_timeout_s, num_workers=rl.reward_workers)
    return GRPOParts(sets=sets, encoder=encoder, engine=engine, manager=manager, reference=reference)


class GRPOLoopStep:
    """The loop's step object of a GRPO run (`training.loop.StepRunner`)."""

    def __init__(self, ctx: RunContext, train_set: Any, grpo: GRPOStep,
                 evaluate: Optional[Callable[[int], Optional[dict]]] = None):
        self.rl, self.seed = ctx.cfg.rl, ctx.cfg.train.seed
        self.train_set, self.grpo, self._evaluate = train_set, grpo, evaluate
        self._batches = None

    def load_data_state(self, state: dict, step: int) -> None:  # noqa: ARG002 (the order is a function of the step)
        if state.get("seed", self.seed) != self.seed or state.get("num_prompts", len(self.train_set)) != len(self.train_set):
            log.warning("resuming with a different seed or prompt set than the checkpoint's (%s): the prompt order differs", state)

    def data_state(self, step: int) -> dict:
        return {"next_step": step, "seed": self.seed, "num_prompts": len(self.train_set)}

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        if self._batches is None:
            self._batches = prompt_batches(len(self.train_set), self.rl.prompts_per_step, seed=self.seed, start_step=step)
        metrics = self.grpo.run(step, [self.train_set[i] for i in next(self._batches)], prompt_pool=self.train_set)
        metrics["epoch"] = (step + 1) * self.rl.prompts_per_step / len(self.train_set)
        return metrics if log else {}

    def evaluate(self, step: int) -> Optional[dict]:
        return self._evaluate(step) if self._evaluate is not None else None

    def finish(self) -> None:
        """Nothing to summarise; the reward workers belong to `GRPOParts` (closed by its owner)."""
