"""One synchronous GRPO step: prompts -> rollout -> rewards -> advantages -> log-probs -> update.

Data parallelism: the step's prompts (the same list on every rank) are dealt round-robin; each rank
generates all G samples of its prompts, so every group — and its advantages — lives on one rank.
Ranks then train on their own samples; the loss of a mini-batch is normalised by the *global* count
of its response tokens (token-mean) or sequences (seq-mean) and multiplied by the data-parallel size
(FSDP averages gradients), so the update equals the one-process update of the whole mini-batch.

Lock-step: FSDP collectives require every rank to make the same forward / backward calls. Ranks
with fewer valid prompts generate for dummy copies (not scored, not trained), decoding runs until
every rank is done (the engine's `all_ranks_active`), and ranks with fewer micro-batches in a
mini-batch run dummy micro-batches whose loss is multiplied by 0.

Randomness is a pure function of (train.seed, step, rank): the sampling generator and the
mini-batch order, so a resumed run repeats the uninterrupted one exactly.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.models.common.prefix_sharing import accepts_prefix_segments
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_gather_objects, all_reduce_max, all_reduce_sum
from megatron_vlm.rl.advantages import GroupAdvantages, advantage_stats, compute_group_advantages, overlong_penalty
from megatron_vlm.rl.batching import (
    TrainSample,
    group_by_prompt,
    pack_samples,
    plan_micro_batches,
    plan_shared_micro_batches,
    split_by_response,
)
from megatron_vlm.rl.data import PromptSample
from megatron_vlm.rl.losses import kl_penalty, policy_loss, rollout_correction_mask
from megatron_vlm.rl.metrics import PhaseTimer, length_metrics, reward_metrics
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch
from megatron_vlm.rl.rollout.engine import RolloutEngine, RolloutPrompt, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.training.step_guard import StepGuard

__all__ = ["GRPOStep", "EncodedShard", "encode_shard", "sampling_generator"]

log = logging.getLogger("megatron_vlm")


def sampling_generator(seed: int, step: int, rank: int, device: torch.device, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + step) * 8191 + rank) * 31 + salt)
    return g


@dataclass
class EncodedShard:
    samples: list[PromptSample]
    """This rank's valid prompts."""
    prompts: list[RolloutPrompt]
    """Their encodings, followed by dummy copies up to the largest shard of any rank."""

    @property
    def num_real(self) -> int:
        return len(self.samples)


def encode_shard(batch: Sequence[PromptSample], encoder, rank: int, world: int, device: torch.device) -> EncodedShard:
    """Encode this rank's share of `batch` (round-robin) and pad it with dummies to the largest share."""
    mine, encoded = [], []
    for s in batch[rank::world]:
        e = encoder.encode(s)
        if e is not None:
            mine.append(s)
            encoded.append(e)
    (longest,) = all_reduce_max([len(encoded)], device)
    if longest == 0:  # every rank sees 0: all raise. Bad data or a model that cannot read it (text-only, images)
        last = getattr(encoder, "last_skip", None)
        raise ConfigError(f"data: none of the {len(batch)} prompts of this step could be encoded"
                          + (f"; the last one skipped: {last}" if last else "") + " (the warnings above name more)")
    if len(encoded) < longest:
        filler = encoded[0] if encoded else next((e for e in map(encoder.encode, batch) if e is not None), None)
        if filler is None:
            raise RuntimeError("GRPO: this rank has no valid prompt to pad its share with")
        encoded += [filler] * (longest - len(encoded))
    return EncodedShard(mine, encoded)


@dataclass
class _Round:
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


def _mismatch_sums(samples: Sequence[TrainSample]) -> dict:
    """Sums for the rollout / training mismatch metrics over the samples' tokens: rho = pi_old / pi_rollout
    (training-side recomputed old log-probs vs the rollout engine's), k3 of KL(pi_rollout || pi_old)."""
    out = {"n": 0, "kl": 0.0, "ratio": 0.0, "min": math.inf, "max": -math.inf, "mis_dropped": 0, "seqs": len(samples)}
    for s in samples:
        d = (s.old_logp.double() - s.behav_logp.double()).clamp(-20.0, 20.0)
        rho = torch.exp(d)
        out["n"] += int(d.numel())
        out["kl"] += float(kl_penalty(s.behav_logp.double(), s.old_logp.double(), "k3").sum())
        out["ratio"] += float(rho.sum())
        out["min"] = min(out["min"], float(rho.min()))
        out["max"] = max(out["max"], float(rho.max()))
    return out


def _mis_keep(s: TrainSample, cap: float) -> bool:
    """MIS: the sample's geometric-mean ratio pi_old / pi_rollout lies in [1/cap, cap]."""
    n = s.response_length
    return bool(rollout_correction_mask(s.old_logp, s.behav_logp, torch.ones(n, dtype=torch.bool), cap=cap,
                                        seq_ids=torch.zeros(n, dtype=torch.long)).all())


class GRPOStep:
    """`run(step, prompts) -> metrics`. `ctx`: the run context (config, ranks, device); `bundle`: the
    policy (`wrapper`, `trainable_params`, `dims`, `moe_balancer`); `optim`: optimizer + scheduler;
    `metrics`: where a MoE workload report's expert table goes (None: not logged)."""

    def __init__(self, ctx, bundle, optim, rl_cfg, engine: RolloutEngine, encoder, manager, reference=None, metrics=None):
        self.ctx, self.bundle, self.optim = ctx, bundle, optim
        self.rl, self.engine, self.encoder, self.manager, self.reference = rl_cfg, engine, encoder, manager, reference
        self.metrics_logger = metrics
        self.device = ctx.env.device
        # data-parallel coordinates: the tp ranks of a group generate, score and train on the same prompts
        dims = bundle.dims
        self.rank, self.world = getattr(dims, "dp_rank", ctx.env.rank), dims.dp_size
        self.copies = getattr(dims, "data_copies", 1)
        self.dp = bundle.dims.dp_size
        self.max_tokens = ctx.cfg.data.max_tokens_per_pack
        self.max_grad_norm = ctx.cfg.train.max_grad_norm
        self.seed = ctx.cfg.train.seed
        self.acc_label = rl_cfg.accuracy_label()
        self.guard = StepGuard.from_config(ctx.cfg.train, self.device, what="GRPO update")
        # rewards that all fail stop the run (configs built in code without the key, e.g. test doubles: never)
        self.reward_watch = RewardFailureWatch(getattr(rl_cfg, "reward_max_failed_steps", 0))
        # asynchronous GRPO with stale samples: the decoupled loss (proximal vs behaviour policy)
        self.decoupled = getattr(rl_cfg, "allocation", None) is not None and getattr(rl_cfg, "max_head_offpolicyness", 0) > 0
        self.share_prompts, why = self._prompt_sharing()
        model = getattr(bundle, "model", None)
        args = getattr(model, "args", None)
        self.vision_ids = frozenset(int(t) for t in (getattr(args, "image_token_id", None), getattr(args, "video_token_id", None))
                                    if t is not None)
        if ctx.env.rank == 0 and model is not None:
            log.info("rl.prompt_sharing: %s (%s)", "on" if self.share_prompts else "off", why)
        self.skip_zero_adv, why_skip = self._skip_zero_advantage()
        if ctx.env.rank == 0 and model is not None:
            log.info("rl.skip_zero_advantage: %s (%s)", "on" if self.skip_zero_adv else "off", why_skip)

    def _prompt_sharing(self) -> tuple[bool, str]:
        """Whether the training forwards pack each prompt once per group (`rl.prompt_sharing`), and why."""
        if getattr(self.rl, "prompt_sharing", "auto") == "off":
            return False, "rl.prompt_sharing = 'off'"
        model = getattr(self.bundle, "model", None)
        if model is None or not accepts_prefix_segments(model):
            return False, f"{type(model).__name__}'s decoder does not support shared prompts"
        dims = self.bundle.dims
        if getattr(dims, "tp", 1) > 1 or getattr(dims, "cp", 1) > 1:
            return False, "not with tensor or context parallelism"
        return True, "each prompt packed once per group in the training forwards"

    def _skip_zero_advantage(self) -> tuple[bool, str]:
        """Whether the update leaves zero-advantage completions out (`rl.skip_zero_advantage`): only where their
        gradient is exactly zero, and why."""
        r = self.rl
        if not getattr(r, "skip_zero_advantage", True):
            return False, "rl.skip_zero_advantage = false"
        if self.reference is not None or r.kl_coef > 0:
            return False, "kl_coef > 0: the KL term has a gradient at advantage 0"
        if r.entropy_coef > 0:
            return False, "entropy_coef > 0: the entropy bonus has a gradient at advantage 0"
        if getattr(self.bundle, "moe_balancer", None) is not None:
            return False, "MoE layers: their auxiliary loss and load statistics see every token"
        return True, "completions with advantage 0 are not forwarded in the update (their gradient is 0)"

    def trains(self, s: TrainSample) -> bool:
        """Whether the update forwards sample `s` (False: a zero-advantage completion it leaves out)."""
        return not (self.skip_zero_adv and s.advantage == 0.0)

    def sampling_params(self) -> SamplingParams:
        r = self.rl
        return SamplingParams(max_new_tokens=r.max_new_tokens, n=r.group_size, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop))

    def _sum(self, values, device=None) -> list[float]:
        """Element-wise sum over the data shards (each counted once, not once per tp rank)."""
        out = all_reduce_sum(values, device if device is not None else self.device)
        return out if self.copies == 1 else [v / self.copies for v in out]

    def _gather(self, obj) -> list:
        """[obj of data shard 0, obj of data shard 1, ...]: one rank per tp group (tp is the innermost
        mesh dim, so the group of world rank r is r // tp)."""
        return all_gather_objects(obj)[::self.copies]

    # ------------------------------------------------------------------ the step
    def run(self, step: int, batch: Sequence[PromptSample], prompt_pool: Optional[Sequence[PromptSample]] = None) -> dict[str, float]:
        """Run GRPO step `step` (0-based: the policy version that generates) on the global prompt batch.

        `prompt_pool` (the training set): where dynamic sampling draws the prompts of its extra rounds
        (a function of (seed, step, round)); without it an extra round samples `batch` again."""
        timer = PhaseTimer()
        r = self.rl
        self.engine.load_weights(None, version=step)
        rounds: list[_Round] = []
        kept_before = surplus = 0
        for rnd in range(r.max_sampling_rounds if r.dynamic_sampling else 1):
            prompts = batch if rnd == 0 else self._round_prompts(step, rnd, batch, prompt_pool)
            rd = self._sample_round(step, rnd, prompts, timer)
            rounds.append(rd)
            if not r.dynamic_sampling:
                break
            # every rank decides alike: the kept (non-zero variance) groups of this round, per rank
            counts = [int(c) for c in self._sum([sum(rd.keep_group) if i == self.rank else 0
                                                      for i in range(self.world)], self.device)]
            need = r.prompts_per_step - kept_before
            if sum(counts) >= need:  # enough: drop the surplus of this round, ranks in order
                quota = []
                for c in counts:
                    quota.append(min(c, need))
                    need -= quota[-1]
                surplus = sum(counts) - sum(quota)
                mine = quota[self.rank]
                for gi, k in enumerate(rd.keep_group):
                    if k:
                        rd.keep_group[gi] = mine > 0
                        mine -= 1
                break
            kept_before += sum(counts)
        return self.train_on_rounds(step, rounds, timer, surplus=surplus)

    def train_on_rounds(self, step: int, rounds: Sequence["_Round"], timer: PhaseTimer, *, surplus: int = 0,
                        extra_metrics: Optional[dict] = None) -> dict[str, float]:
        """Everything after generation and scoring: log-probs, updates, metrics. The synchronous `run`
        and the asynchronous trainer (rl/async_trainer.py, rounds built from the rollout ranks'
        completions) share it. With `rl.max_head_offpolicyness > 0` the loss is the decoupled PPO
        loss: old_logp = the proximal policy (recomputed under the current weights before the
        update), behav_logp = the rollout's, weight capped by `rl.behav_imp_weight_cap`."""
        r, G = self.rl, self.rl.group_size
        train_samples: list[TrainSample] = []
        masked_truncated = 0
        for rd in rounds:
            for i, s in enumerate(rd.real):
                if not rd.keep_group[i // G]:
                    continue
                if r.mask_truncated and s.truncated:
                    masked_truncated += 1
                    continue
                train_samples.append(TrainSample(prompt=rd.shard.prompts[s.prompt_index], response_ids=s.token_ids,
                                                 behav_logp=s.logprobs, advantage=float(rd.adv.advantages[i]),
                                                 old_logp=s.logprobs))
        first = rounds[0].result.samples[0]
        dummy = TrainSample(prompt=rounds[0].shard.prompts[0], response_ids=first.token_ids, behav_logp=first.logprobs,
                            advantage=0.0, old_logp=first.logprobs, ref_logp=first.logprobs)
        if self.reference is not None:
            with timer.phase("ref"):
                self._reference_logprobs(train_samples, dummy)
        mismatch = None
        # The decoupled loss's proximal policy is the trainer's weights before this step's update. With a single
        # update per step (one epoch, one mini-batch) those are the weights of the update's own forward, so the
        # proximal log-probs are that forward's, detached (`_update`), and the extra forward is skipped: the same
        # loss value and gradient (ratio exp(0) = 1 instead of exp(+-1e-7)), ~30 % less trainer time per step.
        proximal_in_update = (self.decoupled and not r.recompute_logprobs and r.ppo_epochs == 1
                              and r.mini_batches_per_step == 1 and r.rollout_correction == "none")
        if (r.recompute_logprobs or self.decoupled) and not proximal_in_update:
            # MIS decides per sample from its old log-probs (a drop changes the normaliser): every sample; otherwise a
            # zero-advantage sample's old log-probs reach only its zero loss term, so the skipped ones are not forwarded
            needs_old = train_samples if r.rollout_correction == "mis" else [s for s in train_samples if self.trains(s)]
            with timer.phase("old_logprob"):
                self._recompute_old_logprobs(needs_old, dummy)
            # over the samples whose old log-probs were recomputed (as when the update's own forward gives them)
            mismatch = _mismatch_sums(needs_old)
            if r.rollout_correction == "mis":
                kept = [s for s in train_samples if _mis_keep(s, r.rollout_correction_cap)]
                mismatch["mis_dropped"] = len(train_samples) - len(kept)
                train_samples = kept
        with timer.phase("train"):
            self.bundle.wrapper.train()
            upd = self._update(step, train_samples, dummy, proximal_from_forward=proximal_in_update)
        forwarded = [s for s in train_samples if self.trains(s)]
        if proximal_in_update:  # old_logp = the update forward's (pre-update) log-probs, of the samples it forwarded
            mismatch = _mismatch_sums(forwarded)
        extra = {"rounds": len(rounds), "surplus": surplus, "masked_truncated": masked_truncated, "mismatch": mismatch,
                 "zero_adv_skipped": len(train_samples) - len(forwarded)}
        out = self._metrics(step, timer, rounds, upd, extra)
        out.update(extra_metrics or {})
        return out

    def _round_prompts(self, step: int, rnd: int, batch: Sequence[PromptSample],
                       pool: Optional[Sequence[PromptSample]]) -> Sequence[PromptSample]:
        """The prompts of dynamic-sampling round rnd >= 1: len(batch) prompts of the pool drawn by
        (seed, step, round) — the same on every rank and in a resumed run — or `batch` again."""
        if not pool:
            return batch
        rng = random.Random(((self.seed * 1_000_003 + step) * 7919 + rnd) * 104_729 + 17)
        return [pool[i] for i in rng.sample(range(len(pool)), min(len(batch), len(pool)))]

    def _sample_round(self, step: int, rnd: int, prompts: Sequence[PromptSample], timer: PhaseTimer) -> "_Round":
        """Generate, score, shape and compute the advantages of one round of prompts."""
        G = self.rl.group_size
        with timer.phase("rollout"):
            shard = encode_shard(prompts, self.encoder, self.rank, self.world, self.device)
            self.bundle.wrapper.eval()
            result = self.engine.generate(shard.prompts, self.sampling_params(),
                                          generator=sampling_generator(self.seed, step, self.rank, self.device, salt=rnd))
            self.engine.release_memory()
        real = result.samples[: shard.num_real * G]
        with timer.phase("reward"):
            total, per_reward = self._score(shard, real)
        return self.shape_round(shard, result, real, total, per_reward)

    def shape_round(self, shard: EncodedShard, result: RolloutResult, real: list[RolloutSample], total: list[float],
                    per_reward: dict[str, list[float]]) -> "_Round":
        """A scored round: overlong shaping, group advantages, the groups to train on."""
        r, G = self.rl, self.rl.group_size
        penalty: list[float] = []
        if r.overlong_buffer > 0 and real:
            penalty = overlong_penalty([int(s.token_ids.numel()) for s in real], r.max_new_tokens,
                                       r.overlong_buffer, r.overlong_penalty)
            total = [t + p for t, p in zip(total, penalty)]
        adv = compute_group_advantages(torch.tensor(total, dtype=torch.float32), G, estimator=r.advantage,
                                       normalize_std=r.adv_normalize_std(),
                                       drop_equal_reward_groups=r.drop_equal_reward_groups or r.dynamic_sampling) if real else None
        keep_group = [bool(k) for k in adv.keep[::G].tolist()] if adv is not None else []
        return _Round(shard=shard, result=result, real=real, total=total, per_reward=per_reward, penalty=penalty,
                      adv=adv, keep_group=keep_group)

    # ------------------------------------------------------------------ phases
    def _score(self, shard: EncodedShard, real) -> tuple[list[float], dict[str, list[float]]]:
        if not real:
            return [], {label: [] for label in self.manager.labels}
        G = self.rl.group_size
        owners = [shard.samples[s.prompt_index] for s in real]
        scored = self.manager.score([s.text for s in real], [p.answer for p in owners], prompts=[p.problem for p in owners],
                                    metadata=[p.metadata for p in owners])
        assert len(scored.total) == shard.num_real * G
        return scored.total, scored.per_reward

    def _packs(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        if self.share_prompts:  # a group's samples next to each other, so that a pack holds their prompt once
            samples = group_by_prompt(samples)
            plan = plan_shared_micro_batches(samples, self.max_tokens, self.vision_ids)
        else:
            plan = plan_micro_batches([s.num_tokens for s in samples], self.max_tokens)
        return [[samples[i] for i in group] for group in plan]

    def _pack(self, group: Sequence[TrainSample]) -> dict:
        return self.ctx.to_device(pack_samples(group, share_prompts=self.share_prompts, vision_token_ids=self.vision_ids))

    @torch.no_grad()
    def _reference_logprobs(self, samples: Sequence[TrainSample], dummy: TrainSample) -> None:
        packs = self._packs(samples)
        n = len(packs)
        if getattr(self.reference, "collective", False):  # the sharded policy's forward: same count on every rank
            (n,) = all_reduce_max([len(packs)], self.device)
        with self.reference.on_device():
            for i in range(n):
                group = packs[i] if i < len(packs) else [dummy]
                logp = self.reference.token_logprobs(self._pack(group))
                if i < len(packs):
                    for s, piece in zip(group, split_by_response(logp.float().cpu(), group)):
                        s.ref_logp = piece

    @torch.no_grad()
    def _recompute_old_logprobs(self, samples: Sequence[TrainSample], dummy: TrainSample) -> None:
        packs = self._packs(samples)
        (n,) = all_reduce_max([len(packs)], self.device)
        self.bundle.wrapper.eval()
        for i in range(n):
            group = packs[i] if i < len(packs) else [dummy]
            logp = self.bundle.wrapper(self._pack(group), temperature=self.rl.temperature)
            if i < len(packs):
                for s, piece in zip(group, split_by_response(logp.float().cpu(), group)):
                    s.old_logp = piece

    def _update(self, step: int, samples: list[TrainSample], dummy: TrainSample, *, proximal_from_forward: bool = False) -> dict:
        """The optimizer updates of one step. `proximal_from_forward` (a single update): each sample's old_logp is
        set from this forward's detached log-probs before the loss (the proximal policy = the current weights)."""
        r, wrapper, optimizer = self.rl, self.bundle.wrapper, self.optim.optimizer
        balancer = getattr(self.bundle, "moe_balancer", None)  # None without MoE layers (and on light test bundles)
        sums: dict[str, float] = {}  # token-weighted sums of the loss metrics over this rank's micro-batches
        weights: dict[str, float] = {}
        losses, grad_norms = [], []
        diff_sum = diff_n = 0.0
        train_tokens = 0
        updates = 0
        for epoch in range(r.ppo_epochs):
            order = list(range(len(samples)))
            random.Random(((self.seed * 1_000_003 + step) * 131 + epoch) * 8191 + self.rank).shuffle(order)
            for m in range(r.mini_batches_per_step):
                mb = [samples[i] for i in order[m::r.mini_batches_per_step]]
                # the normaliser counts every sample of the mini-batch, the forwards skip zero-advantage ones
                packs = self._packs([s for s in mb if self.trains(s)])
                g_tokens, g_seqs = self._sum([sum(s.response_length for s in mb), len(mb)], self.device)
                (n_packs,) = all_reduce_max([len(packs)], self.device)
                if g_tokens == 0:
                    continue  # every group of this mini-batch was dropped on every rank
                # nothing left to forward anywhere (all advantages 0): one dummy forward, so every parameter gets
                # its zero gradient and the optimizer steps (momentum, weight decay) as it would have
                n_packs = max(n_packs, 1)
                normalizer = {"token-mean": g_tokens, "seq-mean": g_seqs}.get(r.loss_agg, g_seqs * r.max_new_tokens)
                loss_sum = 0.0
                for i in range(n_packs):
                    is_real = i < len(packs)
                    group = packs[i] if is_real else [dummy]
                    batch = self._pack(group)
                    logp, ent = wrapper(batch, temperature=r.temperature, return_entropy=True)
                    # MoE auxiliary loss of this forward (None without MoE layers or aux_loss_coef = 0),
                    # averaged over the mini-batch's packs as the SFT loop averages over micro-batches
                    aux = balancer.aux_loss() if balancer is not None else None
                    if not is_real:
                        (logp.sum() * 0.0 + (aux * 0.0 if aux is not None else 0.0)).backward()
                        continue
                    train_tokens += int(batch["input_ids"].numel())
                    if proximal_from_forward:
                        for s, piece in zip(group, split_by_response(logp.detach().float().cpu(), group)):
                            s.old_logp = piece
                    out = self._loss(logp, ent, group, normalizer)
                    total_loss = out.loss * self.dp
                    if aux is not None:
                        total_loss = total_loss + aux / n_packs
                    total_loss.backward()
                    loss_sum += float(out.loss.detach())
                    n_tok = float(out.num_tokens)
                    for k, v in out.metrics.items():
                        if k != "pg_loss" and not k.startswith("mismatch_"):  # mismatch: once per step, in run()
                            sums[k] = sums.get(k, 0.0) + float(v) * n_tok
                            weights[k] = weights.get(k, 0.0) + n_tok
                    if epoch == 0 and m == 0:  # the policy before any update of this step vs the rollout's numbers
                        behav = torch.cat([s.behav_logp for s in group]).to(logp.device)
                        diff_sum += float((logp.detach().float() - behav).abs().sum())
                        diff_n += float(behav.numel())
                grad_norms.append(float(clip_grad_norm_(self.bundle.trainable_params, self.max_grad_norm)))
                if self.guard.allow(loss_sum, grad_norms[-1], step=step + 1):  # non-finite: skip, count
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss_sum)
                updates += 1
        lr = self.optim.scheduler.get_last_lr()[0]  # the lr of this step's updates (step() moves to the next)
        self.optim.scheduler.step()
        # MoE load balancing once per GRPO step, as the SFT loop does per optimizer step: the loads of
        # all this step's training forwards (summed over ranks) move the score-correction biases, and
        # every n_step_per_workload_report steps the moe/* metrics and the expert-load table are reported
        moe_report = balancer.after_step(step + 1) if balancer is not None else None
        if moe_report is not None and self.metrics_logger is not None:
            self.metrics_logger.log_moe_table(step + 1, moe_report[1])
        return {"lr": lr, "moe": moe_report[0] if moe_report is not None else None, "sums": sums, "weights": weights, "losses": losses, "grad_norms": grad_norms, "updates": updates,
                "diff": (diff_sum, diff_n), "train_tokens": train_tokens}

    def _loss(self, logp, ent, group: Sequence[TrainSample], normalizer: float):
        r = self.rl
        lengths = torch.tensor([s.response_length for s in group], device=logp.device)
        adv = torch.repeat_interleave(torch.tensor([s.advantage for s in group], device=logp.device), lengths)
        old = torch.cat([s.old_logp for s in group]).to(logp.device)
        ref = torch.cat([s.ref_logp for s in group]).to(logp.device) if self.reference is not None else None
        seq_ids = torch.repeat_interleave(torch.arange(len(group), device=logp.device), lengths)
        mask = torch.ones_like(logp, dtype=torch.bool)
        rollout = torch.cat([s.behav_logp for s in group]).to(logp.device) if r.rollout_correction != "none" else None
        behav = torch.cat([s.behav_logp for s in group]).to(logp.device) if self.decoupled else None
        return policy_loss(
            logp, old, adv.to(logp.dtype), mask, clip_ratio_low=r.clip_ratio_low, clip_ratio_high=r.clip_ratio_high,
            loss_agg=r.loss_agg, variant=r.policy_loss, seq_ids=seq_ids, normalizer=float(normalizer),
            ref_logp=ref, kl_coef=r.kl_coef, kl_estimator=r.kl_estimator, entropy=ent,
            entropy_coef=r.entropy_coef, rollout_logp=rollout, rollout_correction=r.rollout_correction,
            rollout_correction_cap=r.rollout_correction_cap, behav_logp=behav,
            behav_imp_weight_cap=r.behav_imp_weight_cap if self.decoupled else None,
        )

    # ------------------------------------------------------------------ metrics
    def _metrics(self, step, timer, rounds: Sequence[_Round], upd, extra) -> dict[str, float]:
        G = self.rl.group_size
        real = [x for rd in rounds for x in rd.real]
        trained = []  # per real sample: its group is trained (mask_truncated is counted separately)
        for rd in rounds:
            trained += [rd.keep_group[i // G] for i in range(len(rd.real))]
        zero_var = [bool(z) for rd in rounds if rd.adv is not None for z in rd.adv.zero_variance.tolist()]
        local = {
            "total": [t for rd in rounds for t in rd.total],
            "per_reward": {label: [v for rd in rounds for v in rd.per_reward.get(label, [])] for label in self.manager.labels},
            "penalty": [p for rd in rounds for p in rd.penalty],
            "lengths": [int(s.token_ids.numel()) for s in real], "truncated": [s.truncated for s in real],
            "adv": [a for rd in rounds if rd.adv is not None for a in rd.adv.advantages.tolist()], "keep": trained,
            "dropped": sum(rd.adv.num_dropped_groups for rd in rounds if rd.adv is not None),
            "groups": len(zero_var), "zero_var": sum(zero_var), "kept_groups": sum(sum(rd.keep_group) for rd in rounds),
            "masked_truncated": extra["masked_truncated"], "mismatch": extra["mismatch"],
            "zero_adv_skipped": extra["zero_adv_skipped"],
            "sums": upd["sums"], "weights": upd["weights"], "diff": upd["diff"], "train_tokens": upd["train_tokens"],
            "gen_tokens": sum(int(s.token_ids.numel()) for s in real), "skipped": self.encoder.skipped,
            "reward_fail": self.manager.metrics(), "prompts": sum(rd.shard.num_real for rd in rounds),
        }
        parts = self._gather(local)
        cat = lambda key: [x for p in parts for x in p[key]]  # noqa: E731
        per = {label: [x for p in parts for x in p["per_reward"].get(label, [])] for label in self.manager.labels}
        out: dict[str, float] = {}
        # loss (mean over the optimizer updates of this step; identical on every rank once summed)
        losses = [sum(v) for v in zip(*self._gather(upd["losses"]))] if upd["losses"] else []
        out["loss"] = sum(losses) / len(losses) if losses else 0.0
        out["grad_norm"] = sum(upd["grad_norms"]) / len(upd["grad_norms"]) if upd["grad_norms"] else 0.0
        out["lr"] = upd["lr"]
        out["skipped_steps"] = float(self.guard.skipped)
        if upd.get("moe"):
            out.update(upd["moe"])
        out.update(reward_metrics(cat("total"), per, accuracy_label=self.acc_label, threshold=self.rl.eval.correct_threshold))
        out.update(length_metrics(cat("lengths"), cat("truncated")))
        out.update(advantage_stats(torch.tensor(cat("adv")), torch.tensor(cat("keep"), dtype=torch.bool)))
        out["advantage/dropped_groups"] = float(sum(p["dropped"] for p in parts))
        groups = sum(p["groups"] for p in parts)
        if groups:
            out["reward/zero_var_group_frac"] = sum(p["zero_var"] for p in parts) / groups
        if self.rl.overlong_buffer > 0 and cat("penalty"):
            out["reward/overlong_penalty"] = sum(cat("penalty")) / len(cat("penalty"))
        if self.rl.dynamic_sampling:
            out["sampling/rounds"] = float(extra["rounds"])
            out["sampling/extra_rounds"] = float(extra["rounds"] - 1)
            out["sampling/kept_groups"] = float(sum(p["kept_groups"] for p in parts))
            out["sampling/dropped_groups"] = float(sum(p["dropped"] for p in parts))
            out["sampling/surplus_groups"] = float(extra["surplus"])
        if self.rl.mask_truncated:
            out["train/masked_truncated"] = float(sum(p["masked_truncated"] for p in parts))
        if self.skip_zero_adv:
            out["train/zero_adv_skipped"] = float(sum(p["zero_adv_skipped"] for p in parts))
        mm = [p["mismatch"] for p in parts if p["mismatch"] is not None]
        n_tok = sum(m["n"] for m in mm)
        if n_tok:
            out["rollout/mismatch_kl"] = sum(m["kl"] for m in mm) / n_tok
            out["rollout/mismatch_ratio_mean"] = sum(m["ratio"] for m in mm) / n_tok
            out["rollout/mismatch_ratio_min"] = min(m["min"] for m in mm)
            out["rollout/mismatch_ratio_max"] = max(m["max"] for m in mm)
            if self.rl.rollout_correction == "mis":
                out["rollout/mis_dropped_frac"] = sum(m["mis_dropped"] for m in mm) / max(1, sum(m["seqs"] for m in mm))
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for p in parts:
            for k, v in p["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
                weights[k] = weights.get(k, 0.0) + p["weights"][k]
        out.update({f"actor/{k}": sums[k] / weights[k] for k in sorted(sums) if weights[k] > 0})
        diff_sum, diff_n = (sum(p["diff"][0] for p in parts), sum(p["diff"][1] for p in parts))
        if diff_n:
            out["rollout/logprob_abs_diff"] = diff_sum / diff_n
        out["rollout/policy_version"] = float(step)
        out["rollout/prompts"] = float(sum(p["prompts"] for p in parts))
        gen_tokens = float(sum(p["gen_tokens"] for p in parts))
        train_tokens = float(sum(p["train_tokens"] for p in parts))
        out.update(timer.metrics({"rollout": gen_tokens, "train": train_tokens}))
        out["tokens_per_s"] = out.get("perf/train_tokens_per_s", 0.0)
        out["data/skipped_prompts"] = float(sum(p["skipped"] for p in parts))
        for k in parts[0]["reward_fail"]:
            out[k] = float(sum(p["reward_fail"][k] for p in parts))
        self.reward_watch.update(out, step + 1, getattr(self.manager, "last_error", ""))  # summed over ranks: the same on every rank
        return out
