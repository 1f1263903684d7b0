"""The multi-turn rollout of a GRPO round: environments, engine and the trajectories' rewards, built once per run.

`MultiTurnRounds.from_config(rl, max_tokens_per_pack, engine, processor, data=data_cfg)` is what `[rl.env]` adds to a
GRPO job: the environment worker pool (the `[rl.reward_pool]` sizes and memory cap, `[rl.env]` turn_timeout_s as the
deadline of each call), the `[data]` media limits of the observations (rl/env/observation_limits.py), the
chat-template turn encoder, the engine's multi-turn loop. `generate(shard, params, seed)`
rolls out the G trajectories of each of this rank's real prompts (dummy prompts of data parallelism are not
rolled out: nothing of theirs is scored or trained) and returns them with a `RolloutResult` view for the step
metrics (the model's tokens as the "completion": lengths, truncation).

A trajectory's reward = the `[[rl.rewards]]` verifiers on its last model turn + the environment's per-turn
rewards summed or discounted (`[rl.env]` turn_rewards). Its seed is a function of (train.seed, step, rank,
round), as single-turn sampling is, so a resumed run repeats the same trajectories (environments must be
deterministic functions of their sample and the model's turns for that).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, cast

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.inference.engine import RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout, Trajectory
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.observation_limits import ObservationLimits
from megatron_vlm.rl.env.pool import EnvWorkerPool, InlineEnvRunner, build_environment, resolve_environment
from megatron_vlm.rl.env.session import EnvSession, ToolPromptEncoder, env_sample
from megatron_vlm.rl.env.turns import TurnEncoder

__all__ = ["MultiTurnRounds", "rollout_view", "multiturn_seed", "multiturn_rollout", "environment_tools"]

log = logging.getLogger("megatron_vlm")

def multiturn_seed(seed: int, step: int, rank: int, rnd: int = 0) -> int:
    """The seed of a rank's multi-turn rollout of a step's round (each conversation's generator derives from it): a
    function of (train.seed, step, rank, round), the same in the synchronous loop and on asynchronous rollout rank
    `rank`, so a resumed run, and the asynchronous loop at max_head_offpolicyness = 0, repeat the same trajectories."""
    return ((seed * 1_000_003 + step) * 8191 + rank) * 31 + rnd


def multiturn_rollout(engine: Any, processor: Any) -> MultiTurnRollout:
    """The engine's multi-turn loop: vLLM's request API (inference/vllm_multiturn.py) or the built-in engine's."""
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    if isinstance(engine, VLLMRolloutEngine):
        from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout

        return VLLMMultiTurnRollout(engine, tokenizer=processor.tokenizer)
    return MultiTurnRollout(engine)


def rollout_view(t: Trajectory) -> RolloutSample:
    """The trajectory as a single-turn sample for scoring and metrics: its model tokens, its last turn's text."""
    ids = t.token_ids[t.model_mask]
    return RolloutSample(prompt_index=t.prompt_index, sample_index=t.sample_index, token_ids=ids, logprobs=t.logprobs,
                         text=t.text, finish_reason=cast(Any, "length" if t.truncated else "eos"),
                         prompt_length=t.prompt_length, policy_version=t.policy_version,
                         token_versions=t.token_versions)


def environment_tools(cfg: RLEnvConfig, *, verifiers: bool = True) -> list[dict]:
    """The tool specs of `[rl.env]`'s environment, built once in this process; a ConfigError naming the key to fix
    (rl.env.name, rl.env.kwargs) when the class cannot be found, its constructor does not take the kwargs, it fails
    or its `tools()` does not give JSON tool specs (they go into every prompt's system turn); without `verifiers`
    (no [[rl.rewards]] table), one naming rl.rewards when the environment gives no reward of its own
    (`Environment.gives_rewards`): every trajectory's reward would be 0; and one naming rl.env.turn_rewards when
    such an environment is given turn_rewards / discount settings, which would shape nothing."""
    import inspect
    import json

    from megatron_vlm.errors import ConfigError

    try:
        factory = resolve_environment(cfg.name)
    except Exception as e:  # noqa: BLE001 - an import error of the user's module too
        raise ConfigError(f"rl.env.name: {cfg.name!r} cannot be imported: {type(e).__name__}: {e}") from None
    try:
        inspect.signature(factory).bind(**cfg.kwargs)
    except TypeError as e:
        raise ConfigError(f"rl.env.kwargs: {dict(cfg.kwargs)} do not fit the constructor of {cfg.name!r} ({e})") from None
    except ValueError:  # no signature to read (a builtin): the call below tells
        pass
    try:
        env = build_environment(cfg.name, cfg.kwargs)
        tools = list(env.tools())
        json.dumps(tools)
        if not all(isinstance(t, dict) for t in tools):
            raise TypeError("tools() must return a list of JSON-schema dicts")
    except Exception as e:  # noqa: BLE001 - user code
        raise ConfigError(f"rl.env.name: the environment {cfg.name!r} could not be built or give its tool specs: "
                          f"{type(e).__name__}: {e}") from None
    if not verifiers and not getattr(env, "gives_rewards", True):
        raise ConfigError(f"rl.rewards: no [[rl.rewards]] table, and the environment {cfg.name!r} gives no reward of "
                          "its own (a tool environment without a reward function): every trajectory would score 0; "
                          "add a [[rl.rewards]] verifier of the final answer")
    if not getattr(env, "gives_rewards", True) and (cfg.turn_rewards != "sum" or cfg.discount != 1.0):
        raise ConfigError(f"rl.env.turn_rewards: {cfg.turn_rewards!r} (discount {cfg.discount}) shapes the environment's "
                          f"per-turn rewards, and the environment {cfg.name!r} gives no reward of its own (a tool "
                          "environment without a reward function; the [[rl.rewards]] verifiers score the final answer): "
                          "remove rl.env.turn_rewards and rl.env.discount")
    return tools


class MultiTurnRounds:
    def __init__(self, cfg: RLEnvConfig, engine: Any, processor: Any, *, max_total_tokens: int, runner: Any,
                 tools: Optional[list[dict]] = None, limits: Optional[ObservationLimits] = None):
        self.cfg, self.runner = cfg, runner
        self.media = limits or ObservationLimits()
        """The `[data]` media limits of the observations (held to in the workers)."""
        self.tools = tools if tools is not None else list(build_environment(cfg.name, cfg.kwargs).tools())
        self.rollout = multiturn_rollout(engine, processor)
        self.turns = TurnEncoder(processor)
        self.limits = MultiTurnLimits(max_turns=cfg.max_turns, max_total_tokens=max_total_tokens)
        self.eos = sorted(engine.eos_token_ids)
        self.errors = 0

    @classmethod
    def from_config(cls, rl: Any, max_tokens_per_pack: int, engine: Any, processor: Any, *,
                    data: Any = None) -> MultiTurnRounds:
        """`data`: the `[data]` table, whose max_frames / max_image_pixels / max_video_pixels the observations are held
        to (None: their defaults)."""
        cfg: RLEnvConfig = rl.env
        total = cfg.max_total_tokens or max_tokens_per_pack
        if total > max_tokens_per_pack:
            from megatron_vlm.errors import ConfigError

            raise ConfigError(f"rl.env.max_total_tokens: {total} exceeds data.max_tokens_per_pack = {max_tokens_per_pack} "
                              "(a trajectory is trained as one packed sample); lower it or raise the pack size")
        # before any worker: a bad name / kwargs stops the job here (exit 2)
        tools = environment_tools(cfg, verifiers=bool(rl.rewards))
        pool = rl.reward_pool
        runner: Any = (EnvWorkerPool(num_workers=pool.workers, timeout_s=cfg.turn_timeout_s,
                                     memory_limit_mb=pool.memory_limit_mb, preload=(cfg.name,),
                                     batch_timeout_s=cfg.batch_timeout_s or None)
                       if cfg.sandbox else InlineEnvRunner())
        if cfg.sandbox:
            failed = runner.start()
            if failed:
                runner.close()
                from megatron_vlm.errors import ConfigError

                raise ConfigError(f"rl.env.name: {cfg.name!r} cannot be imported in the worker processes: "
                                  f"{next(iter(failed.values()))}")
        return cls(cfg, engine, processor, max_total_tokens=total, runner=runner, tools=tools,
                   limits=ObservationLimits.from_data(data) if data is not None else None)

    def prompt_encoder(self, encoder: Any) -> Any:
        """The prompt encoder whose prompts carry the environment's tools in their system turn and leave room under
        max_total_tokens (longer ones skipped and counted: `ToolPromptEncoder`)."""
        return ToolPromptEncoder(encoder, self.tools, max_total_tokens=self.limits.max_total_tokens,
                                 processor=self.turns.proc)

    def generate(self, shard: Any, params: SamplingParams, seed: int, *,
                 abandon: Optional[Callable[[], bool]] = None) -> tuple[RolloutResult, list[Trajectory]]:
        """The round's trajectories; `abandon`: the stop check of the environment calls' waits and of the built-in
        loop's decode steps (True: they are given up and `WaitAbandoned` ends the rollout; rewards/pool.py)."""
        real = shard.num_real
        if real == 0:
            return RolloutResult(samples=[]), []
        prompts = shard.prompts[:real]
        # a stop while generating: the built-in loop gives up between decode steps too
        gen_wait = {"abandon": abandon} if abandon is not None and getattr(self.rollout, "takes_abandon", False) else {}
        try:
            messages = [self.prompt_encoder_messages(s) for s in shard.samples]
            session = EnvSession(self.runner, self.turns, name=self.cfg.name, kwargs=self.cfg.kwargs,
                                 samples=[env_sample(s, p) for s, p in zip(shard.samples, prompts)], histories=messages,
                                 n=params.n, eos_token_ids=self.eos, tools=self.tools, limits=self.media,
                                 tool_timeout_s=self.cfg.tool_deadline_s(), turn_timeout_s=self.cfg.turn_timeout_s,
                                 abandon=abandon)
        except (Exception, WaitAbandoned) as err:  # the resets given up or failed on this rank (not an environment's
            # own failure: an error reply), before the loop: a tensor-parallel engine's other ranks leave with it
            leave = getattr(self.rollout, "leave_together", None)
            if leave is not None:
                leave(failed=not isinstance(err, WaitAbandoned))
            raise
        trajs = self.rollout.generate(prompts, params, session, self.limits, seed=seed, **gen_wait)
        session.settle(trajs)
        self.errors += session.errors
        if session.errors:
            log.warning("multi-turn rollout: %d environment errors this round (last: %s)", session.errors,
                        session.last_error)
        samples = [rollout_view(t) for t in trajs]
        stats = dict(self.rollout.stats)
        return RolloutResult(samples=samples, num_generated_tokens=sum(int(s.token_ids.numel()) for s in samples),
                             seconds=stats.get("seconds", 0.0), stats=stats), trajs

    def prompt_encoder_messages(self, sample: Any) -> list[dict]:
        return ToolPromptEncoder(None, self.tools, processor=self.turns.proc).messages(sample)

    def rewards(self, trajs: list[Trajectory]) -> list[float]:
        """The environment's share of each trajectory's reward ([rl.env] turn_rewards)."""
        return [self.cfg.trajectory_return(t.turn_rewards) for t in trajs]

    def close(self) -> None:
        self.runner.close()
