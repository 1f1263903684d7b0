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
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_gather_objects, all_reduce_max, all_reduce_sum
from megatron_vlm.rl.advantages import advantage_stats, compute_group_advantages
from megatron_vlm.rl.batching import TrainSample, pack_samples, plan_micro_batches, split_by_response
from megatron_vlm.rl.data import PromptSample
from megatron_vlm.rl.losses import policy_loss
from megatron_vlm.rl.metrics import PhaseTimer, length_metrics, reward_metrics
from megatron_vlm.rl.rollout.engine import RolloutEngine, RolloutPrompt, SamplingParams
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
    if longest == 0:
        raise RuntimeError(f"GRPO: none of the {len(batch)} prompts of this step could be encoded (see the warnings above)")
    if len(encoded) < longest:
        filler = encoded[0] if encoded else next((e for e in map(encoder.encode, batch) if e is not None), None)
        if filler is None:
            raise RuntimeError("GRPO: this rank has no valid prompt to pad its share with")
        encoded += [filler] * (longest - len(encoded))
    return EncodedShard(mine, encoded)


class GRPOStep:
    """`run(step, prompts) -> metrics`. `ctx`: the run context (config, ranks, device); `bundle`: the
    policy (`wrapper`, `trainable_params`, `dims`, `moe_balancer`); `optim`: optimizer + scheduler;
    `metrics`: where a MoE workload report's expert table goes (None: not logged)."""

    def __init__(self, ctx, bundle, optim, rl_cfg, engine: RolloutEngine, encoder, manager, reference=None, metrics=None):
        self.ctx, self.bundle, self.optim = ctx, bundle, optim
        self.rl, self.engine, self.encoder, self.manager, self.reference = rl_cfg, engine, encoder, manager, reference
        self.metrics_logger = metrics
        self.device = ctx.env.device
        self.rank, self.world = ctx.env.rank, ctx.env.world_size
        self.dp = bundle.dims.dp_size
        self.max_tokens = ctx.cfg.data.max_tokens_per_pack
        self.max_grad_norm = ctx.cfg.train.max_grad_norm
        self.seed = ctx.cfg.train.seed
        self.acc_label = rl_cfg.accuracy_label()
        self.guard = StepGuard.from_config(ctx.cfg.train, self.device, what="GRPO update")

    def sampling_params(self) -> SamplingParams:
        r = self.rl
        return SamplingParams(max_new_tokens=r.max_new_tokens, n=r.group_size, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop))

    # ------------------------------------------------------------------ the step
    def run(self, step: int, batch: Sequence[PromptSample]) -> dict[str, float]:
        """Run GRPO step `step` (0-based: the policy version that generates) on the global prompt batch."""
        timer = PhaseTimer()
        G = self.rl.group_size
        with timer.phase("rollout"):
            shard = encode_shard(batch, self.encoder, self.rank, self.world, self.device)
            self.engine.load_weights(None, version=step)
            self.bundle.wrapper.eval()
            result = self.engine.generate(shard.prompts, self.sampling_params(),
                                          generator=sampling_generator(self.seed, step, self.rank, self.device))
            self.engine.release_memory()
        real = result.samples[: shard.num_real * G]
        with timer.phase("reward"):
            total, per_reward = self._score(shard, real)
        adv = compute_group_advantages(torch.tensor(total, dtype=torch.float32), G,
                                       normalize_std=self.rl.normalize_adv_std,
                                       drop_equal_reward_groups=self.rl.drop_equal_reward_groups) if real else None
        train_samples = [
            TrainSample(prompt=shard.prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs,
                        advantage=float(adv.advantages[i]), old_logp=s.logprobs)
            for i, s in enumerate(real) if bool(adv.keep[i])
        ] if real else []
        first = result.samples[0]
        dummy = TrainSample(prompt=shard.prompts[0], response_ids=first.token_ids, behav_logp=first.logprobs,
                            advantage=0.0, old_logp=first.logprobs, ref_logp=first.logprobs)
        if self.reference is not None:
            with timer.phase("ref"):
                self._reference_logprobs(train_samples)
        if self.rl.recompute_logprobs:
            with timer.phase("old_logprob"):
                self._recompute_old_logprobs(train_samples, dummy)
        with timer.phase("train"):
            self.bundle.wrapper.train()
            upd = self._update(step, train_samples, dummy)
        return self._metrics(step, timer, result, shard, real, total, per_reward, adv, upd)

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
        plan = plan_micro_batches([s.num_tokens for s in samples], self.max_tokens)
        return [[samples[i] for i in group] for group in plan]

    @torch.no_grad()
    def _reference_logprobs(self, samples: Sequence[TrainSample]) -> None:
        with self.reference.on_device():
            for group in self._packs(samples):
                logp = self.reference.token_logprobs(self.ctx.to_device(pack_samples(group)))
                for s, piece in zip(group, split_by_response(logp.float().cpu(), group)):
                    s.ref_logp = piece

    @torch.no_grad()
    def _recompute_old_logprobs(self, samples: Sequence[TrainSample], dummy: TrainSample) -> None:
        packs = self._packs(samples)
        (n,) = all_reduce_max([len(packs)], self.device)
        self.bundle.wrapper.eval()
        for i in range(n):
            group = packs[i] if i < len(packs) else [dummy]
            logp = self.bundle.wrapper(self.ctx.to_device(pack_samples(group)), temperature=self.rl.temperature)
            if i < len(packs):
                for s, piece in zip(group, split_by_response(logp.float().cpu(), group)):
                    s.old_logp = piece

    def _update(self, step: int, samples: list[TrainSample], dummy: TrainSample) -> dict:
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
                packs = self._packs(mb)
                g_tokens, g_seqs = all_reduce_sum([sum(s.response_length for s in mb), len(mb)], self.device)
                (n_packs,) = all_reduce_max([len(packs)], self.device)
                if g_tokens == 0:
                    continue  # every group of this mini-batch was dropped on every rank
                normalizer = g_tokens if r.loss_agg == "token-mean" else g_seqs
                loss_sum = 0.0
                for i in range(n_packs):
                    is_real = i < len(packs)
                    group = packs[i] if is_real else [dummy]
                    batch = self.ctx.to_device(pack_samples(group))
                    logp, ent = wrapper(batch, temperature=r.temperature, return_entropy=True)
                    # MoE auxiliary loss of this forward (None without MoE layers or aux_loss_coef = 0),
                    # averaged over the mini-batch's packs as the SFT loop averages over micro-batches
                    aux = balancer.aux_loss() if balancer is not None else None
                    if not is_real:
                        (logp.sum() * 0.0 + (aux * 0.0 if aux is not None else 0.0)).backward()
                        continue
                    train_tokens += int(batch["input_ids"].numel())
                    out = self._loss(logp, ent, group, normalizer)
                    total_loss = out.loss * self.dp
                    if aux is not None:
                        total_loss = total_loss + aux / n_packs
                    total_loss.backward()
                    loss_sum += float(out.loss.detach())
                    n_tok = float(out.num_tokens)
                    for k, v in out.metrics.items():
                        if k != "pg_loss":
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
        return policy_loss(
            logp, old, adv.to(logp.dtype), mask, clip_ratio_low=r.clip_ratio_low, clip_ratio_high=r.clip_ratio_high,
            loss_agg=r.loss_agg, seq_ids=seq_ids, normalizer=float(normalizer), ref_logp=ref, kl_coef=r.kl_coef,
            kl_estimator=r.kl_estimator, entropy=ent,
        )

    # ------------------------------------------------------------------ metrics
    def _metrics(self, step, timer, result, shard, real, total, per_reward, adv, upd) -> dict[str, float]:
        local = {
            "total": total, "per_reward": per_reward,
            "lengths": [int(s.token_ids.numel()) for s in real], "truncated": [s.truncated for s in real],
            "adv": adv.advantages.tolist() if adv is not None else [], "keep": adv.keep.tolist() if adv is not None else [],
            "dropped": adv.num_dropped_groups if adv is not None else 0,
            "sums": upd["sums"], "weights": upd["weights"], "diff": upd["diff"], "train_tokens": upd["train_tokens"],
            "gen_tokens": sum(int(s.token_ids.numel()) for s in real), "skipped": self.encoder.skipped,
            "reward_fail": self.manager.metrics(), "prompts": shard.num_real,
        }
        parts = all_gather_objects(local)
        cat = lambda key: [x for p in parts for x in p[key]]  # noqa: E731
        per = {label: [x for p in parts for x in p["per_reward"].get(label, [])] for label in self.manager.labels}
        out: dict[str, float] = {}
        # loss (mean over the optimizer updates of this step; identical on every rank once summed)
        losses = [sum(v) for v in zip(*all_gather_objects(upd["losses"]))] if upd["losses"] else []
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
        return out
