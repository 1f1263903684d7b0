"""Held-out accuracy of the policy during GRPO: Avg@k (and pass@k) with the rollout engine.

The held-out prompts (`[rl.eval] max_prompts` of them, in file order) are dealt round-robin over
the ranks; each rank generates k completions per prompt with the evaluation sampling settings
(greedy by default), scores them with the accuracy reward only, and the per-prompt scores of all
ranks are combined (megatron_vlm.eval.accuracy). The same engine call pads shards with dummy
prompts so that every rank makes the same forward calls. Sampling is seeded by (seed, step, rank).

Held-out prompts that cannot be encoded are skipped and counted (the run's bad records, and
`skipped_prompts` of the metrics, each once); a held-out set none of whose prompts encodes gives
`num_prompts` 0 and a warning, not a stopped run: found at an evaluation in the middle of training, the
error lost every step since the last checkpoint.

A stop signal while the evaluation waits on hung verifiers or environments: the wait gives up once the stop has been
pending `ABANDON_GRACE_S` (rl/rewards/pool.py), every rank agrees (rl/give_up.py, after the answers are scored, before
they are gathered) and all raise `EvaluationAbandoned` (the loop logs nothing of it, saves and exits 143) rather than
wait out `rl.reward_pool.batch_timeout_s`, longer than a scheduler's warning before its kill.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.errors import ConfigError
from megatron_vlm.eval.accuracy import avg_at_k, pass_at_k, score_accuracy
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.generators import sampling_generator
from megatron_vlm.parallel.collectives import all_gather_objects
from megatron_vlm.rl.give_up import agreed_give_up
from megatron_vlm.rl.prompts.shard import encode_shard
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.signals import EvaluationAbandoned

__all__ = ["GRPOEvaluator", "evaluate_accuracy"]

log = logging.getLogger("megatron_vlm")

_EVAL_SALT = 17


class GRPOEvaluator:
    """`evaluate_accuracy` bound to a run's parts: `GRPOEvaluator(...)(step) -> metrics | None`."""

    def __init__(self, ctx: RunContext, wrapper, rl_cfg, engine, encoder, manager, dataset, *, dims=None,
                 multiturn=None):
        self.args = (ctx, wrapper, rl_cfg, engine, encoder, manager, dataset)
        self.dims, self.multiturn = dims, multiturn

    def __call__(self, step: int) -> Optional[dict[str, float]]:
        return evaluate_accuracy(*self.args, step, dims=self.dims, multiturn=self.multiturn)


@torch.no_grad()
def evaluate_accuracy(ctx: RunContext, wrapper, rl_cfg, engine, encoder, manager, dataset,
                      step: int, *, dims=None, multiturn=None) -> Optional[dict[str, float]]:
    """Metrics "accuracy" (= Avg@k), "avg@k", "pass@k", "num_prompts", "skipped_prompts", "response_length",
    "reasoning_unclosed" (the share of samples scored 0 for lacking the accuracy reward's `reasoning_end`), or
    None without a held-out set. `wrapper`: the policy's FSDP root (put in eval mode while generating).
    `dims` (`ParallelDims`): prompts are sharded over its data-parallel ranks (the tp ranks of a group
    generate the same answers); None = one shard per process. `multiturn` ([rl.env]: rl/env/rollout.py
    `MultiTurnRounds`): each sample is a whole conversation with the environment, scored on its last model turn as
    the training rollout's reward is (a single completion would be the tool-trained model's first turn: its call),
    or with the accuracy label "env" (no [[rl.rewards]] table, or rl.accuracy_reward = "env") by the environment's
    return of each conversation; "response_length" then counts the model's tokens of all turns, and "env_errors" the
    conversations whose environment failed (each scored 0)."""
    if dataset is None or len(dataset) == 0:
        return None
    e = rl_cfg.eval
    prompts = dataset.samples[: e.max_prompts] if e.max_prompts else dataset.samples
    env = ctx.env
    rank, world = (dims.dp_rank, dims.dp_size) if dims is not None else (env.rank, env.world_size)
    copies = dims.data_copies if dims is not None else 1
    skipped_before = int(getattr(encoder, "skipped", 0))
    try:
        shard = encode_shard(prompts, encoder, rank, world, env.device)
    except ConfigError as err:  # on every rank alike (the shard sizes are all-reduced): no held-out prompt encodes
        skipped = sum(all_gather_objects(int(getattr(encoder, "skipped", 0)) - skipped_before)[::copies])
        log.warning("GRPO held-out evaluation at step %d: no prompt could be scored (%s)", step, err)
        return {"num_prompts": 0.0, "skipped_prompts": float(skipped)}
    params = SamplingParams(max_new_tokens=e.max_new_tokens or rl_cfg.rollout.max_new_tokens, n=e.k, temperature=e.temperature,
                            top_p=e.top_p, stop=tuple(rl_cfg.rollout.stop))
    # hook: an engine with its own weights (vLLM, the built-in engine's copy: rl.rollout.weights = "copy" /
    # "expert_parallel", refreshed at each step's start, before its update) gets the current ones
    sync = getattr(engine, "sync_to_version", None)
    if sync is not None:
        sync(step)
    stop_check = getattr(getattr(ctx, "stop", None), "pending", None)  # stand-in contexts of tests: none
    gave_up: Optional[WaitAbandoned] = None
    try:
        real, scores, unclosed, env_errors = _answers(ctx, wrapper, rl_cfg, engine, manager, shard, params, step, rank,
                                                      multiturn=multiturn, abandon=stop_check)
    except WaitAbandoned as err:
        gave_up = err
    if stop_check is not None and (why := agreed_give_up(gave_up, env.device)):
        raise EvaluationAbandoned(why)
    k = e.k
    parts = all_gather_objects({"scores": scores, "lengths": [int(s.token_ids.numel()) for s in real],
                                "skipped": int(getattr(encoder, "skipped", 0)) - skipped_before,
                                "unclosed": unclosed, "env_errors": env_errors})[::copies]
    all_scores = [row for p in parts for row in p["scores"]]
    lengths = [n for p in parts for n in p["lengths"]]
    if not all_scores:
        return None
    correct = [sum(s >= e.correct_threshold for s in row) for row in all_scores]
    avg = avg_at_k(all_scores, e.correct_threshold)
    return {
        "accuracy": avg,
        f"avg@{k}": avg,
        f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(correct),
        "num_prompts": float(len(all_scores)),
        "skipped_prompts": float(sum(p["skipped"] for p in parts)),
        "response_length": sum(lengths) / max(len(lengths), 1),
        # the share of samples whose reasoning never closed (the accuracy reward's reasoning_end): each scored 0
        "reasoning_unclosed": sum(p["unclosed"] for p in parts) / max(sum(len(r) for r in all_scores), 1),
        # [rl.env]: conversations whose environment failed (each scored 0)
        **({"env_errors": float(sum(p["env_errors"] for p in parts))} if multiturn is not None else {}),
    }


def _answers(ctx: RunContext, wrapper, rl_cfg, engine, manager, shard, params: SamplingParams, step: int, rank: int, *,
             multiturn=None, abandon: Optional[Callable[[], bool]] = None) -> tuple[list, list[list[float]], int, int]:
    """(this rank's real samples, their accuracy scores [prompt][sample], the samples whose reasoning never closed,
    the conversations whose environment failed). `abandon`: the stop check of the waits on the verifiers and the
    environments and of the built-in engine's generation (`WaitAbandoned`)."""
    real, scores, unclosed, failed = _scored_answers(ctx, wrapper, rl_cfg, engine, manager, shard, params, step, rank,
                                                     multiturn=multiturn, abandon=abandon)
    # a conversation whose environment failed (env_error: raised, hung, died) scores 0, counted in env_errors: its
    # last model turn or partial return says nothing of the model (training leaves it out of the update)
    k, gone = rl_cfg.eval.k, set(failed)
    scores = [[0.0 if p * k + j in gone else s for j, s in enumerate(row)] for p, row in enumerate(scores)]
    return real, scores, unclosed, len(failed)


def _scored_answers(ctx: RunContext, wrapper, rl_cfg, engine, manager, shard, params: SamplingParams, step: int,
                    rank: int, *, multiturn=None,
                    abandon: Optional[Callable[[], bool]] = None) -> tuple[list, list[list[float]], int, list[int]]:
    """`_answers` before the failed conversations (their indices among the real samples, the last item) score 0."""
    e = rl_cfg.eval
    wait = {"abandon": abandon} if abandon is not None else {}
    wrapper.eval()
    returns: Optional[list[float]] = None
    failed: list[int] = []
    try:
        if multiturn is not None:  # the seed: never a training round's (their round numbers are >= 0)
            from megatron_vlm.rl.env.rollout import multiturn_seed

            result, trajs = multiturn.generate(shard, params, multiturn_seed(ctx.cfg.train.seed, step, rank, -_EVAL_SALT),
                                               **wait)
            failed = [i for i, t in enumerate(trajs[:shard.num_real * params.n]) if t.finish_reason == "env_error"]
            if rl_cfg.accuracy_label() == "env":  # the environment's return is the accuracy reward
                returns = multiturn.rewards(trajs)
        else:
            result = engine.generate(shard.prompts, params,
                                     generator=sampling_generator(ctx.cfg.train.seed, step, rank, ctx.env.device,
                                                                  salt=_EVAL_SALT),
                                     **(wait if getattr(engine, "takes_abandon", False) else {}))
    finally:  # also when an environment's wait was given up
        engine.release_memory()
        wrapper.train()
    k = e.k
    real = result.samples[: shard.num_real * k]
    if real and returns is not None:
        return real, [list(returns[p * k:(p + 1) * k]) for p in range(shard.num_real)], 0, failed
    if not real:
        return real, [], 0, []
    completions = [[s.text for s in real[p * k:(p + 1) * k]] for p in range(shard.num_real)]
    acc = score_accuracy(manager, completions, [p.answer for p in shard.samples], [p.problem for p in shard.samples],
                         [p.metadata for p in shard.samples], label=rl_cfg.accuracy_label(), threshold=e.correct_threshold,
                         samples=shard.samples, **wait)  # a model reward reads the prompt's messages, as in training
    return real, acc.scores, acc.unclosed, failed
