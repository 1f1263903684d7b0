"""One synchronous GRPO step: prompts -> rounds (rollout, rewards, advantages) -> policy update -> metrics.

The parts, each in its own module: the rounds and DAPO's dynamic sampling (`rounds.py`), the policy update
with its reference / old log-probs and loss (`policy_update.py`), the metrics (`step_metrics.py`). This
object only wires them: `run` for the synchronous loop, `train_on_rounds` for both loops (the asynchronous
trainer builds its rounds from the rollout ranks' completions).

Lock-step: FSDP collectives require every rank to make the same forward / backward calls; the rounds pad a
rank's prompts with dummies and the update pads its micro-batches (see those modules). Randomness is a pure
function of (train.seed, step, rank): the sampling generator and the mini-batch order, so a resumed run
repeats the uninterrupted one exactly.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_vlm.inference.engine import RolloutEngine
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.env.trajectories import trajectory_counts, trajectory_metrics_of, trajectory_train_sample
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.rl.policy_update import PolicyUpdate
from megatron_vlm.rl.prompts.dataset import PromptSample
from megatron_vlm.rl.prompts.shard import PromptEncoding
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch, RewardsAllFailedError
from megatron_vlm.rl.rounds import RewardScorer, Round, RoundSampler
from megatron_vlm.rl.step_metrics import StepCounts, step_metrics

__all__ = ["GRPOStep"]


class GRPOStep:
    """`run(step, prompts) -> metrics`. `ctx`: the run context (config, ranks, device); `bundle`: the
    policy (`wrapper`, `trainable_params`, `dims`, `moe_balancer`); `optim`: optimizer + scheduler;
    `engine`, `encoder`, `manager`: rollout engine, prompt encoder, reward manager; `reference`: the frozen
    reference policy (kl_coef > 0); `metrics`: where a MoE workload report's expert table goes (None: not
    logged); `critic`: PPO's critic (advantage = "gae", rl/critic/build.py) or None. `rounds` and `policy` are the
    two parts, public for the asynchronous trainer and benchmarks."""

    def __init__(self, ctx: Any, bundle: Any, optim: Any, rl_cfg: Any, engine: RolloutEngine, encoder: PromptEncoding,
                 manager: RewardScorer, reference: Any = None, metrics: Any = None, critic: Any = None,
                 multiturn: Any = None):
        self.rl = rl_cfg
        self.encoder, self.manager = encoder, manager
        # data-parallel coordinates: the tp ranks of a group generate, score and train on the same prompts
        self.shards = DataShards.of(bundle.dims, ctx.env.rank, ctx.env.device)
        self.policy = PolicyUpdate(ctx, bundle, optim, rl_cfg, shards=self.shards, reference=reference, metrics=metrics,
                                   critic=critic)
        # a stopping rank gives up a hung reward / environment wait (training/signals.py; stand-in contexts: never)
        stop = getattr(ctx, "stop", None)
        self.rounds = RoundSampler(rl_cfg, engine, encoder, manager, shards=self.shards, seed=ctx.cfg.train.seed,
                                   eval_mode=lambda: bundle.wrapper.eval(), multiturn=multiturn,
                                   stop_check=getattr(stop, "pending", None))
        self.engine = engine
        # steps without a usable reward (every verifier call or environment episode failed) for
        # reward_pool.max_failed_steps steps stop the run (configs built in code: never)
        pool = getattr(rl_cfg, "reward_pool", None)
        self.reward_watch = RewardFailureWatch(getattr(pool, "max_failed_steps", 0), key="rl.reward_pool.max_failed_steps")

    def run(self, step: int, batch: Sequence[PromptSample],
            prompt_pool: Optional[Sequence[PromptSample]] = None) -> dict[str, float]:
        """Run GRPO step `step` (0-based: the policy version that generates) on the global prompt batch.

        `prompt_pool` (the training set): where dynamic sampling draws the prompts of its extra rounds
        (a function of (seed, step, round)); without it an extra round samples `batch` again."""
        timer = PhaseTimer()
        with timer.phase("weight_sync"):  # the rollout copy's refresh (copy / expert-parallel) is part of the step
            self.engine.load_weights(None, version=step)
        rounds, surplus = self.rounds.sample(step, batch, prompt_pool, timer)
        return self.train_on_rounds(step, rounds, timer, surplus=surplus)

    def train_on_rounds(self, step: int, rounds: Sequence[Round], timer: PhaseTimer, *, surplus: int = 0,
                        extra_metrics: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Everything after generation and scoring: log-probs, updates, metrics. The synchronous `run`
        and the asynchronous trainer (rl/asynchronous/trainer.py, rounds built from the rollout ranks'
        completions) share it. With `rl.asynchronous.max_head_offpolicyness > 0` the loss is the decoupled PPO
        loss: old_logp = the proximal policy (recomputed under the current weights before the
        update), behav_logp = the rollout's, weight capped by `rl.loss.behav_imp_weight_cap`."""
        r, G = self.rl, self.rl.batch.group_size
        train_samples: list[TrainSample] = []
        masked_truncated = env_errors = 0
        for rd in rounds:
            for i, s in enumerate(rd.real):
                if not rd.keep_group[i // G]:
                    continue
                if r.update.mask_truncated and s.truncated:
                    masked_truncated += 1
                    continue
                assert rd.adv is not None
                prompt, adv = rd.shard.prompts[s.prompt_index], float(rd.adv.advantages[i])
                if rd.trajectories is not None:  # [rl.env]: the whole trajectory, loss on the model's tokens
                    t = rd.trajectories[i]
                    if t.finish_reason == "env_error":  # the environment failed, not the model: not trained
                        env_errors += 1
                        continue
                    train_samples.append(trajectory_train_sample(prompt, t, adv))
                    continue
                train_samples.append(TrainSample(prompt=prompt, response_ids=s.token_ids, behav_logp=s.logprobs,
                                                 advantage=adv, old_logp=s.logprobs, routes=s.routes,
                                                 score=float(rd.total[i])))
        dummy = self._dummy(rounds[0])
        upd = self.policy.train(step, train_samples, dummy, timer)
        counts = StepCounts(rounds=len(rounds), surplus=surplus, masked_truncated=masked_truncated,
                            skipped_prompts=getattr(self.encoder, "skipped", 0), reward_failures=self.manager.metrics(),
                            skipped_steps=self.policy.guard.skipped)
        out = step_metrics(r, self.shards, step, timer, rounds, upd, counts, reward_labels=self.manager.labels,
                           zero_adv_on=self.policy.skip_zero_adv)
        out.update(upd.extra)  # PPO's critic/* and its token-level advantage/* (the same on every rank)
        episodes = episode_errors = 0
        env_error = ""
        if self.rounds.multiturn is not None:  # [rl.env] (the same on every rank: the gather is collective)
            trajectories = [t for rd in rounds for t in (rd.trajectories or [])]
            parts = self.shards.gather(trajectory_counts(trajectories, untrained_env_errors=env_errors))
            out.update(trajectory_metrics_of(parts))
            episodes, episode_errors = sum(p["trajectories"] for p in parts), sum(p["errors"] for p in parts)
            env_error = next((t.error for t in reversed(trajectories) if t.finish_reason == "env_error"), "")
        out.update(extra_metrics or {})
        try:  # summed over ranks: the same decision on every rank
            self.reward_watch.update(out, step + 1, getattr(self.manager, "last_error", ""), episodes=episodes,
                                     episode_errors=episode_errors, env_error=env_error)
        except RewardsAllFailedError as e:
            e.metrics = out  # the step ran: the loop logs its row before the run stops
            raise
        return out

    @staticmethod
    def _dummy(rd: Round) -> TrainSample:
        """The sample a rank forwards (loss x 0) when it has fewer packs than another."""
        if rd.result.samples:
            first = rd.result.samples[0]
            return TrainSample(prompt=rd.shard.prompts[0], response_ids=first.token_ids, behav_logp=first.logprobs,
                               advantage=0.0, old_logp=first.logprobs, ref_logp=first.logprobs, routes=first.routes)
        # a multi-turn round of a rank without real prompts rolls nothing out: one token of its (dummy) prompt
        prompt = rd.shard.prompts[0]
        zero = torch.zeros(1)
        return TrainSample(prompt=prompt, response_ids=prompt.input_ids[-1:].clone(), behav_logp=zero, advantage=0.0,
                           old_logp=zero, ref_logp=zero)

    @property
    def reward_labels(self) -> list[str]:
        """The reward manager's labels (the per-reward metrics and the rounds' `per_reward` keys)."""
        return list(self.manager.labels)
