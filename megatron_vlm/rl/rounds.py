"""The generation rounds of a GRPO step: encode, roll out, score, shape, group advantages; and DAPO's
dynamic sampling, which runs further rounds until the step has `rl.batch.prompts_per_step` informative groups.

Why its own module: a round is everything before the policy update, and the asynchronous trainer builds
the same `Round` from completions the rollout ranks sent (`shape_round`), so both loops train on one
shape of data.

Data parallelism: the step's prompts (the same list on every rank) are dealt round-robin; each rank
generates all G samples of its prompts, so every group — and its advantages — lives on one rank. Ranks
with fewer valid prompts generate for dummy copies (not scored, not trained), and decoding runs until
every rank is done (the engine's `all_ranks_active`). The sampling generator is a function of
(seed, step, rank, round) and the prompts of an extra round of (seed, step, round), so a resumed run
repeats the uninterrupted one.

Stopping: the round's long waits (the verifiers' batch, the environments of a multi-turn rollout) and its long work
(the built-in engine's generation, between decode steps; the vLLM engine's, between engine steps; a model reward,
between its packed forwards) ask the stop
check (`stop_check`: training/signals.py `StopFlag.pending`) and give up once it has said stop for a moment
(`WaitAbandoned`, abandon.py `ABANDON_GRACE_S`). The rank that gave up must not skip a collective the others
make, so after the reward phase of every round all ranks agree (rl/give_up.py: one all-reduce) and, if any did, all
raise `StepAbandoned` together, before anything of the step is applied: the loop saves the step's start and the step
is redone on resume. Lock-stepped generation (a collective in every forward) is given up by every rank at the same
decode step (inference/policy_engine.py), the ranks of a tensor-parallel vLLM engine at the same engine step
(inference/vllm_engine.py); a rank that decodes on its own leaves alone, the others join it at the agreement when
their round is done.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.inference.engine import RolloutEngine, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.inference.generators import sampling_generator
from megatron_vlm.rl.advantages import GroupAdvantages, compute_group_advantages, overlong_penalty
from megatron_vlm.rl.algorithms.advantage_estimators import AdvantageSpec
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.give_up import agreed_give_up
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.rl.prompts.dataset import PromptSample
from megatron_vlm.rl.prompts.shard import EncodedShard, PromptEncoding, encode_shard
from megatron_vlm.training.signals import StepAbandoned

__all__ = ["Round", "RoundSampler", "RewardScorer", "shape_round", "sampling_params"]


class RewardScorer(Protocol):
    """What a round needs of the reward manager (`rl.rewards.manager.RewardManager` or a stand-in)."""

    labels: list[str]

    def score(self, texts: list[str], answers: list[Any], *, prompts: list[str], metadata: list[dict],
              abandon: Optional[Callable[[], bool]] = None) -> Any: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass
class Round:
    """One generation round of a step (one, or up to max_sampling_rounds with dynamic sampling)."""
    shard: EncodedShard
    result: RolloutResult
    real: list[RolloutSample]
    """The samples of this rank's real prompts, group-major."""
    total: list[float]
    """Summed reward per sample, overlong penalty included."""
    per_reward: dict[str, list[float]]
    penalty: list[float]
    """Overlong penalty per sample (empty when off)."""
    adv: Optional[GroupAdvantages]
    keep_group: list[bool]
    """Per group of this rank: trained (false: equal rewards dropped, or dynamic sampling's surplus)."""
    trajectories: Optional[list] = None
    """Multi-turn rollouts ([rl.env]): the `Trajectory` of each of `real` (None: single-turn completions)."""


def sampling_params(rl: Any) -> SamplingParams:
    """The rollout's sampling settings from `[rl]`."""
    return SamplingParams(max_new_tokens=rl.rollout.max_new_tokens, n=rl.batch.group_size, temperature=rl.rollout.temperature,
                          top_p=rl.rollout.top_p, top_k=rl.rollout.top_k, stop=tuple(rl.rollout.stop))


def shape_round(rl: Any, advantage: AdvantageSpec, shard: EncodedShard, result: RolloutResult, real: list[RolloutSample],
                total: list[float], per_reward: dict[str, list[float]], trajectories: Optional[list] = None) -> Round:
    """A scored round: overlong shaping, group advantages (`advantage`: built once per run from `[rl]`), the
    groups to train on. `trajectories` ([rl.env]): a trajectory its environment failed ("env_error", not trained)
    is left out of its group's advantages too (`compute_group_advantages` valid)."""
    G = rl.batch.group_size
    penalty: list[float] = []
    if rl.advantages.overlong_buffer > 0 and real:
        penalty = overlong_penalty([int(s.token_ids.numel()) for s in real], rl.rollout.max_new_tokens,
                                   rl.advantages.overlong_buffer, rl.advantages.overlong_penalty)
        total = [t + p for t, p in zip(total, penalty)]
    valid = (torch.tensor([t.finish_reason != "env_error" for t in trajectories])
             if trajectories is not None and real else None)
    adv = compute_group_advantages(torch.tensor(total, dtype=torch.float32), G, estimator=advantage.estimator,
                                   normalize_std=advantage.normalize_std,
                                   drop_equal_reward_groups=advantage.drop_equal_reward_groups, valid=valid) if real else None
    keep_group = [bool(k) for k in adv.keep[::G].tolist()] if adv is not None else []
    return Round(shard=shard, result=result, real=real, total=total, per_reward=per_reward, penalty=penalty,
                 adv=adv, keep_group=keep_group, trajectories=trajectories)


class RoundSampler:
    """`sample(step, batch, pool, timer) -> (rounds, surplus)`: the step's rounds on this rank. `engine`: the
    rollout engine; `encoder`: prompts -> rollout prompts; `rewards`: the reward manager; `eval_mode`: called
    before generating (the policy's forward in eval mode: no dropout); `stop_check`: asked by the round's waits (module
    docstring; None: they never give up, and the rounds make no agreement)."""

    def __init__(self, rl_cfg: Any, engine: RolloutEngine, encoder: PromptEncoding, rewards: RewardScorer, *,
                 shards: DataShards, seed: int, eval_mode: Any = None, multiturn: Any = None,
                 stop_check: Optional[Callable[[], bool]] = None):
        self.rl, self.engine, self.encoder, self.rewards = rl_cfg, engine, encoder, rewards
        self.stop_check = stop_check
        self.multiturn = multiturn  # [rl.env]: rl.env.rollout.MultiTurnRounds (None: single-turn)
        self.shards, self.seed, self._eval_mode = shards, seed, eval_mode
        self.advantage = AdvantageSpec.from_config(rl_cfg)  # validated once here

    def sample(self, step: int, batch: Sequence[PromptSample], pool: Optional[Sequence[PromptSample]],
               timer: PhaseTimer) -> tuple[list[Round], int]:
        """The rounds of step `step` and the surplus groups dropped from the last one (dynamic sampling: every rank
        decides alike from the kept-group counts of all ranks)."""
        r, shards = self.rl, self.shards
        rounds: list[Round] = []
        kept_before = surplus = 0
        for rnd in range(r.advantages.max_sampling_rounds if r.advantages.dynamic_sampling else 1):
            prompts = batch if rnd == 0 else self.round_prompts(step, rnd, batch, pool)
            rd = self.sample_round(step, rnd, prompts, timer)
            rounds.append(rd)
            if not r.advantages.dynamic_sampling:
                break
            # every rank decides alike: the kept (non-zero variance) groups of this round, per rank
            counts = [int(c) for c in shards.sum([sum(rd.keep_group) if i == shards.rank else 0
                                                  for i in range(shards.world)])]
            need = r.batch.prompts_per_step - kept_before
            if sum(counts) >= need:  # enough: drop the surplus of this round, ranks in order
                quota = []
                for c in counts:
                    quota.append(min(c, need))
                    need -= quota[-1]
                surplus = sum(counts) - sum(quota)
                mine = quota[shards.rank]
                for gi, k in enumerate(rd.keep_group):
                    if k:
                        rd.keep_group[gi] = mine > 0
                        mine -= 1
                break
            kept_before += sum(counts)
        return rounds, surplus

    def round_prompts(self, step: int, rnd: int, batch: Sequence[PromptSample],
                      pool: Optional[Sequence[PromptSample]]) -> Sequence[PromptSample]:
        """The prompts of dynamic-sampling round rnd >= 1: len(batch) prompts of the pool drawn by
        (seed, step, round) — the same on every rank and in a resumed run — or `batch` again."""
        if not pool:
            return batch
        rng = random.Random(((self.seed * 1_000_003 + step) * 7919 + rnd) * 104_729 + 17)
        return [pool[i] for i in rng.sample(range(len(pool)), min(len(batch), len(pool)))]

    def sample_round(self, step: int, rnd: int, prompts: Sequence[PromptSample], timer: PhaseTimer) -> Round:
        """Generate, score, shape and compute the advantages of one round of prompts; `StepAbandoned` on every rank
        when a rank gave up a wait of the round because it is stopping (module docstring)."""
        gave_up: Optional[WaitAbandoned] = None
        try:
            out = self._sample_round(step, rnd, prompts, timer)
        except WaitAbandoned as e:
            gave_up = e
            self.engine.release_memory()
        if self.stop_check is not None and (why := agreed_give_up(gave_up, self.shards.device)):
            raise StepAbandoned(why)
        return out

    def _sample_round(self, step: int, rnd: int, prompts: Sequence[PromptSample], timer: PhaseTimer) -> Round:
        G, shards = self.rl.batch.group_size, self.shards
        wait = {"abandon": self.stop_check} if self.stop_check is not None else {}
        with timer.phase("rollout"):
            shard = encode_shard(prompts, self.encoder, shards.rank, shards.world, shards.device)
            if self._eval_mode is not None:
                self._eval_mode()
            trajectories = None
            if self.multiturn is not None:  # the seed: a function of (seed, step, rank, round), as the generator's
                from megatron_vlm.rl.env.rollout import multiturn_seed

                seed = multiturn_seed(self.seed, step, shards.rank, rnd)
                result, trajectories = self.multiturn.generate(shard, sampling_params(self.rl), seed, **wait)
            else:
                # a stop while generating: the built-in engine gives the call up between decode steps
                gen_wait = wait if getattr(self.engine, "takes_abandon", False) else {}
                result = self.engine.generate(shard.prompts, sampling_params(self.rl),
                                              generator=sampling_generator(self.seed, step, shards.rank, shards.device, salt=rnd),
                                              **gen_wait)
            self.engine.release_memory()
        real = result.samples[: shard.num_real * G]
        with timer.phase("reward"):
            total, per_reward = self.score(shard, real, **wait)
            if trajectories is not None:  # + the environment's turn rewards ([rl.env] turn_rewards)
                env = self.multiturn.rewards(trajectories)
                total, per_reward["env"] = [a + b for a, b in zip(total, env)], env
        return shape_round(self.rl, self.advantage, shard, result, real, total, per_reward, trajectories)

    def score(self, shard: EncodedShard, real: Sequence[RolloutSample], *,
              abandon: Optional[Callable[[], bool]] = None) -> tuple[list[float], dict[str, list[float]]]:
        """Summed and per-verifier rewards of this rank's real samples; `abandon`: the reward wait's stop check."""
        if not real:
            return [], {label: [] for label in self.rewards.labels}
        G = self.rl.batch.group_size
        owners = [shard.samples[s.prompt_index] for s in real]
        extra: dict[str, Any] = {"samples": owners} if getattr(self.rewards, "takes_samples", False) else {}  # images
        if abandon is not None:
            extra["abandon"] = abandon
        scored = self.rewards.score([s.text for s in real], [p.answer for p in owners], prompts=[p.problem for p in owners],
                                    metadata=[p.metadata for p in owners], **extra)
        assert len(scored.total) == shard.num_real * G
        return scored.total, scored.per_reward
