"""The policy side of a GRPO step: packed training forwards, reference and old log-probs, the loss and
the optimizer updates.

Why its own object: the synchronous step, the asynchronous trainer and the benchmarks all train on
scored samples the same way; they call `PolicyUpdate.train` (or `update` alone) instead of reaching into
the step. Where the loss's old log-probs come from:

- the rollout's behaviour log-probs (default: the update is on-policy up to rollout numerics);
- recomputed by a training-layout forward before the update (`rl.recompute_logprobs`, then the rollout /
  training mismatch is measured and optionally corrected: TIS in the loss, MIS drops sequences here);
- asynchronous GRPO with stale samples (decoupled PPO): the proximal policy = the trainer's weights before
  the update; with a single update per step those are the weights of the update's own forward, so its
  detached log-probs are used and the extra forward is skipped (the same loss value and gradient: ratio
  exp(0) = 1 instead of exp(+-1e-7); ~30 % less trainer time per step).

Data parallelism: the loss of a mini-batch is normalised by the *global* count of its response tokens
(token-mean) or sequences (seq-mean) and multiplied by the data-parallel size (FSDP averages gradients),
so the update equals the one-process update of the whole mini-batch. Ranks with fewer micro-batches in a
mini-batch run dummy micro-batches whose loss is multiplied by 0 (FSDP's collectives need the same calls
on every rank). The mini-batch order is a function of (seed, step, epoch, rank).

Host reads: on CUDA every read of a device value is a stream sync (the host waits for every queued kernel). An
optimizer update reads the device once, before its optimizer step: its loss sum (this rank's and all ranks', for
the non-finite guard), the gradient norm and the running metric sums (`read_update`); the reference / old log-probs
of a pass are copied to the host once, after its last pack. The losses' per-token inputs (advantages, old / reference
/ rollout log-probs, sequence ids) are built on the host and moved without waiting.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_vlm.host_copies import keep_host_copy, move
from megatron_vlm.inference.policy_engine import vision_token_ids
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.prefix_sharing import accepts_prefix_segments
from megatron_vlm.models.common.routing_replay import context_parallel_of, replaying_routes
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_, all_reduce_max
from megatron_vlm.rl.algorithms.advantage_estimators import batch_normalised, kl_in_reward
from megatron_vlm.rl.algorithms.loss_terms import kl_penalty, rollout_correction_mask
from megatron_vlm.rl.algorithms.policy_losses import PolicyLossOutput, PolicyLossSpec, compute_policy_loss
from megatron_vlm.rl.batch_advantages import BatchAdvantages
from megatron_vlm.rl.batching import (
    TrainSample,
    group_by_prompt,
    pack_samples,
    plan_micro_batches,
    plan_shared_micro_batches,
    split_by_response,
)
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.training.moe_balancing import uncounted_expert_load
from megatron_vlm.training.step_guard import StepGuard

__all__ = ["PolicyUpdate", "UpdateResult", "mismatch_sums", "read_update", "to_host_pieces"]

log = logging.getLogger("megatron_vlm")


@dataclass
class UpdateResult:
    """What one step's updates report to the step metrics (this rank's numbers; summed over ranks there)."""
    lr: float
    """The lr of this step's updates (the scheduler has moved on to the next step's)."""
    moe: Optional[dict[str, float]]
    """The moe/* metrics of a workload report (None: none this step, or no MoE layers)."""
    sums: dict[str, float]
    """Token-weighted sums of the loss metrics over this rank's micro-batches."""
    weights: dict[str, float]
    losses: list[float]
    """Per optimizer update: this rank's share of the loss."""
    grad_norms: list[float]
    updates: int
    diff: tuple[float, float]
    """(sum |log pi - log pi_rollout|, tokens) before any update of this step: a numerics check."""
    train_tokens: int
    mismatch: Optional[dict[str, float]] = None
    """`mismatch_sums` of the samples whose old log-probs were recomputed (None: not recomputed)."""
    routing: Optional[tuple[int, int]] = None
    """(token x layer pairs whose natural top-k expert set differs from the rollout's, recorded pairs) of the first
    training-side forward over the step's samples (None: no routes recorded: not a MoE policy, or vLLM)."""
    zero_adv_skipped: int = 0
    """Samples the update did not forward (advantage 0, `rl.update.skip_zero_advantage`)."""
    extra: dict[str, Any] = field(default_factory=dict)


def mismatch_sums(samples: Sequence[TrainSample]) -> dict[str, float]:
    """Sums for the rollout / training mismatch metrics over the samples' tokens: rho = pi_old / pi_rollout
    (training-side recomputed old log-probs vs the rollout engine's), k3 of KL(pi_rollout || pi_old)."""
    out: dict[str, float] = {"n": 0, "kl": 0.0, "ratio": 0.0, "min": math.inf, "max": -math.inf, "mis_dropped": 0,
                             "seqs": len(samples)}
    for s in samples:
        assert s.old_logp is not None
        d = (s.old_logp.double() - s.behav_logp.double()).clamp(-20.0, 20.0)
        rho = torch.exp(d)
        out["n"] += int(d.numel())
        out["kl"] += float(kl_penalty(s.behav_logp.double(), s.old_logp.double(), "k3").sum())
        out["ratio"] += float(rho.sum())
        out["min"] = min(out["min"], float(rho.min()))
        out["max"] = max(out["max"], float(rho.max()))
    return out


def read_update(loss_sum: torch.Tensor, grad_norm: Any, running: Sequence[torch.Tensor],
                tail: Optional[torch.Tensor] = None) -> tuple[float, float, float, list[float], Optional[torch.Tensor]]:
    """(this rank's loss sum, its sum over all ranks, the gradient norm, the `running` sums, `tail` on the host), in
    one read of the device (module docstring). `loss_sum`, `running`: 0-d float64 on the device; `tail`: a vector
    wanted on the host too (float32 values come back exactly: they pass as float64)."""
    loss = loss_sum.detach().reshape(1)
    everyone = all_reduce_(loss.clone())  # a collective only with several ranks: a non-finite loss anywhere shows
    norm = torch.as_tensor(grad_norm).detach().to(loss.device, torch.float64).reshape(1)
    parts = [loss, everyone, norm, *(r.detach().reshape(1) for r in running)]
    if tail is not None:
        parts.append(tail.detach().to(torch.float64).reshape(-1))
    host = torch.cat(parts).cpu()
    k = 3 + len(running)
    head = host[:k].tolist()
    return head[0], head[1], head[2], head[3:], host[k:] if tail is not None else None


def to_host_pieces(parts: Sequence[tuple[Sequence[TrainSample], torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Per (samples, their packed per-response-token device vector): the samples' float32 pieces on the host, all
    copied in one read of the device."""
    if not parts:
        return []
    flat = torch.cat([v.detach().float().reshape(-1) for _, v in parts]).cpu()
    out, start = [], 0
    for group, v in parts:
        n = v.numel()
        out.append(split_by_response(flat[start:start + n], group))
        start += n
    return out


def _cat(pieces: Sequence[Optional[torch.Tensor]], what: str) -> torch.Tensor:
    """The per-sample tensors of a pack, concatenated (each must have been set: a missing one is a bug)."""
    present = [p for p in pieces if p is not None]
    if len(present) != len(pieces):
        raise RuntimeError(f"GRPO update: a sample has no {what}")
    return torch.cat(present)


def _mis_keep(s: TrainSample, cap: float) -> bool:
    """MIS: the sample's geometric-mean ratio pi_old / pi_rollout lies in [1/cap, cap]."""
    assert s.old_logp is not None
    n = s.response_length
    return bool(rollout_correction_mask(s.old_logp, s.behav_logp, torch.ones(n, dtype=torch.bool), cap=cap,
                                        seq_ids=torch.zeros(n, dtype=torch.long)).all())


class PolicyUpdate:
    """`train(step, samples, dummy, timer)`: reference and old log-probs, then `rl.batch.ppo_epochs` x
    `rl.batch.mini_batches_per_step` optimizer updates. `ctx`: the run context (config, ranks, device, `to_device`);
    `bundle`: the policy (`wrapper`, `trainable_params`, `dims`, `moe_balancer`, `model`); `optim`: optimizer +
    scheduler; `reference`: the frozen reference (kl_coef > 0) or None; `metrics`: where a MoE workload
    report's expert table goes (None: not logged); `critic`: PPO's critic (advantage = "gae", rl/critic/) or None:
    its values give per-token advantages, the KL penalty moves into its rewards, and it is updated after the policy
    in the same step (only it during `rl.critic.warmup_steps`). REINFORCE++ (`rl.advantage = "reinforce_plus_plus"` /
    `"reinforce_plus_plus_baseline"`): per-token advantages whitened over the step (rl/batch_advantages.py), made
    after the reference log-probs; with "reinforce_plus_plus" (or `rl.advantages.kl_in_reward = true`) the KL penalty
    is in their rewards, not the loss."""

    def __init__(self, ctx: Any, bundle: Any, optim: Any, rl_cfg: Any, *, shards: DataShards,
                 reference: Any = None, metrics: Any = None, critic: Any = None):
        self.ctx, self.bundle, self.optim, self.rl = ctx, bundle, optim, rl_cfg
        self.critic = critic
        self.reference, self.metrics_logger, self.shards = reference, metrics, shards
        self.device = shards.device
        self.max_tokens: int = ctx.cfg.data.max_tokens_per_pack
        self.max_grad_norm: float = ctx.cfg.train.max_grad_norm
        self.seed: int = ctx.cfg.train.seed
        self.guard = StepGuard.from_config(ctx.cfg.train, self.device, what="GRPO update")
        # asynchronous GRPO with stale samples: the decoupled loss (proximal vs behaviour policy)
        self.decoupled = rl_cfg.allocation is not None and rl_cfg.asynchronous.max_head_offpolicyness > 0
        # the loss's settings, validated once here (not per micro-batch)
        self.loss_spec = PolicyLossSpec.from_config(rl_cfg, decoupled=self.decoupled)
        self.batch_advantages = BatchAdvantages(rl_cfg, shards) if batch_normalised(rl_cfg.advantage) else None
        if critic is not None or kl_in_reward(rl_cfg.advantage, rl_cfg.advantages.kl_in_reward):
            # PPO-RLHF, REINFORCE++: the KL penalty is in the per-token rewards (the critic's, the returns'), not the loss
            self.loss_spec = dataclasses.replace(self.loss_spec, kl_coef=0.0)
        self.share_prompts, why = self._prompt_sharing()
        model = getattr(bundle, "model", None)
        args = getattr(model, "args", None)
        self.vision_ids = frozenset(int(t) for t in (getattr(args, "image_token_id", None), getattr(args, "video_token_id", None))
                                    if t is not None)
        # every log-prob of the update is of the distribution the rollout engines sample from: the vision tokens
        # (never sampled) removed from the softmax (training/masked_vocab.py); none for a text policy
        # (passed only when there are some: a text policy's forward is called exactly as before)
        ids = tuple(vision_token_ids(model))
        self.mask_kw: dict[str, Any] = {"masked_token_ids": ids} if ids else {}
        if ctx.env.rank == 0 and model is not None:
            log.info("rl.update.prompt_sharing: %s (%s)", "on" if self.share_prompts else "off", why)
        # MoE routing replay (rl.routing_replay = "rollout"): the training forwards route as the rollout did
        self.replay_routes = getattr(rl_cfg, "routing_replay", "off") == "rollout"
        # the recorded routes lie over a training forward that runs every MoE layer on one rank (no pp stages; a
        # context-parallel layer takes its chunks' rows: routing_replay.py): under pp they are dropped (replay
        # itself is refused there: config)
        dims = getattr(bundle, "dims", None)
        self.routes_usable = getattr(dims, "pp", 1) == 1
        wrapper = getattr(bundle, "wrapper", None)
        cpx = context_parallel_of(wrapper) if isinstance(wrapper, torch.nn.Module) and moe_layers(wrapper) else None
        self._route_count_group = cpx.group if cpx is not None and self.routes_usable else None
        if self.replay_routes and isinstance(model := getattr(bundle, "model", None), torch.nn.Module) \
                and not moe_layers(model) and ctx.env.rank == 0:
            log.warning("rl.routing_replay = 'rollout': %s has no MoE layers, nothing is replayed", type(model).__name__)
        self._routes_counted = False
        self._route_counts = [0, 0]
        self.skip_zero_adv, why_skip = self.skip_zero_advantage()
        if ctx.env.rank == 0 and model is not None:
            log.info("rl.update.skip_zero_advantage: %s (%s)", "on" if self.skip_zero_adv else "off", why_skip)

    # ------------------------------------------------------------------ settings
    def _prompt_sharing(self) -> tuple[bool, str]:
        """Whether the training forwards pack each prompt once per group (`rl.update.prompt_sharing`), and why."""
        if self.rl.update.prompt_sharing == "off":
            return False, "rl.update.prompt_sharing = 'off'"
        if self.rl.batch.group_size == 1:
            return False, "rl.batch.group_size = 1: no prompt has two completions to share it"
        model = getattr(self.bundle, "model", None)
        if model is None or not accepts_prefix_segments(model):
            return False, f"{type(model).__name__}'s decoder does not support shared prompts"
        dims = self.bundle.dims
        if getattr(dims, "tp", 1) > 1 or getattr(dims, "cp", 1) > 1:
            return False, "not with tensor or context parallelism"
        balancer = getattr(self.bundle, "moe_balancer", None)
        if getattr(getattr(balancer, "cfg", None), "aux_loss_coef", 0.0) > 0:
            # a shared prompt is routed once, not once per completion: the aux loss and its gradient would change
            return False, "moe.aux_loss_coef > 0: the MoE auxiliary loss sees every token of a pack"
        return True, "each prompt packed once per group in the training forwards"

    def skip_zero_advantage(self) -> tuple[bool, str]:
        """Whether the update leaves zero-advantage completions out (`rl.update.skip_zero_advantage`): only where their
        gradient is exactly zero, and why (decided from the current settings and bundle)."""
        r = self.rl
        if not r.update.skip_zero_advantage:
            return False, "rl.update.skip_zero_advantage = false"
        if self.critic is not None:
            return False, f"advantage = {r.advantage!r}: per-token advantages from the critic"
        if self.batch_advantages is not None:
            return False, f"advantage = {r.advantage!r}: per-token advantages normalised over the step"
        if self.reference is not None or r.loss.kl_coef > 0:
            return False, "kl_coef > 0: the KL term has a gradient at advantage 0"
        if r.loss.entropy_coef > 0:
            return False, "entropy_coef > 0: the entropy bonus has a gradient at advantage 0"
        if getattr(self.bundle, "moe_balancer", None) is not None:
            return False, "MoE layers: their auxiliary loss and load statistics see every token"
        return True, "completions with advantage 0 are not forwarded in the update (their gradient is 0)"

    def trains(self, s: TrainSample) -> bool:
        """Whether the update forwards sample `s` (False: a zero-advantage completion it leaves out)."""
        return not (self.skip_zero_adv and s.advantage == 0.0)

    # ------------------------------------------------------------------ one step
    def train(self, step: int, samples: list[TrainSample], dummy: TrainSample, timer: PhaseTimer) -> UpdateResult:
        """Reference log-probs (kl_coef > 0), old log-probs (recomputed or from the update's forward), MIS, the
        updates. `dummy`: the sample a rank forwards (loss x 0) when it has fewer packs than another."""
        r = self.rl
        self._routes_counted, self._route_counts = False, [0, 0]
        if self.reference is not None:
            with timer.phase("ref"):
                self.reference_logprobs(samples, dummy)
        mismatch = None
        proximal_in_update = (self.decoupled and not r.recompute_logprobs and r.batch.ppo_epochs == 1
                              and r.batch.mini_batches_per_step == 1 and r.loss.rollout_correction == "none")
        if (r.recompute_logprobs or self.decoupled) and not proximal_in_update:
            # MIS decides per sample from its old log-probs (a drop changes the normaliser): every sample; otherwise a
            # zero-advantage sample's old log-probs reach only its zero loss term, so the skipped ones are not forwarded
            needs_old = samples if r.loss.rollout_correction == "mis" else [s for s in samples if self.trains(s)]
            with timer.phase("old_logprob"):
                self.recompute_old_logprobs(needs_old, dummy)
            self._routes_counted = True
            # over the samples whose old log-probs were recomputed (as when the update's own forward gives them)
            mismatch = mismatch_sums(needs_old)
            if r.loss.rollout_correction == "mis":
                kept = [s for s in samples if _mis_keep(s, r.loss.rollout_correction_cap)]
                mismatch["mis_dropped"] = len(samples) - len(kept)
                samples = kept
        extra: dict[str, float] = {}
        if self.batch_advantages is not None:  # REINFORCE++: returns (KL in the reward), whitened over every rank's tokens
            extra = self.batch_advantages.prepare(samples)
        if self.critic is not None:
            with timer.phase("critic"):  # V_old, token rewards, GAE (rl/critic/ppo_critic.py)
                extra = self.critic.prepare(samples, self.packs, self._pack)
        with timer.phase("train"):
            self.bundle.wrapper.train()
            if self.critic is None or self.critic.policy_moves(step):
                out = self.update(step, samples, dummy, proximal_from_forward=proximal_in_update)
            else:  # the critic's warm-up: the policy stays; its schedule counts the step
                out = self.hold(step)
        if self.critic is not None:
            with timer.phase("critic"):
                extra.update(self.critic.update(step, samples, self.packs, self._pack))
            extra["critic/warmup"] = float(not self.critic.policy_moves(step))
        out.extra.update(extra)
        forwarded = [s for s in samples if self.trains(s)]
        if proximal_in_update:  # old_logp = the update forward's (pre-update) log-probs, of the samples it forwarded
            mismatch = mismatch_sums(forwarded)
        out.mismatch = mismatch
        if self._route_count_group is not None:  # each cp rank counted its chunks: the pack's counts are their sum
            counts = torch.tensor(self._route_counts, dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(counts, group=self._route_count_group)
            self._route_counts = [int(v) for v in counts.tolist()]
        out.routing = tuple(self._route_counts) if self._route_counts[1] else None  # type: ignore[assignment]
        out.zero_adv_skipped = len(samples) - len(forwarded)
        return out

    # ------------------------------------------------------------------ forwards
    def packs(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """The samples in micro-batches of at most `data.max_tokens_per_pack` tokens, a new one where a sample's vision
        tensors cannot join the current one's (Nemotron-VL videos of another tile size)."""
        if self.share_prompts:  # a group's samples next to each other, so that a pack holds their prompt once
            samples = group_by_prompt(samples)
            plan = plan_shared_micro_batches(samples, self.max_tokens, self.vision_ids)
        else:
            plan = plan_micro_batches([s.num_tokens for s in samples], self.max_tokens, samples)
        return [[samples[i] for i in group] for group in plan]

    def replay_scope(self, batch: dict[str, Any], *, count: bool):
        """The context of one training forward (and its backward: activation checkpointing re-runs the forward
        there) of a pack with the rollout's MoE routes (`batch["routes"]`, taken out of the batch): the recorded
        experts forced (rl.routing_replay = "rollout") or only compared; `count`: add the pack's routing
        mismatch to this step's `rollout/routing_mismatch_frac`. A null context for packs without routes."""
        routes = batch.pop("routes", None)
        if routes is None or not self.routes_usable:
            return contextlib.nullcontext()
        return self._replaying(routes, count)

    @contextlib.contextmanager
    def _replaying(self, routes, count: bool):
        with replaying_routes(self.bundle.wrapper, routes, force=self.replay_routes) as plan:
            yield plan
        if count:
            d, n = plan.mismatch()
            self._route_counts[0] += d
            self._route_counts[1] += n

    def _pack(self, group: Sequence[TrainSample]) -> dict[str, Any]:
        out: dict[str, Any] = self.ctx.to_device(pack_samples(group, share_prompts=self.share_prompts,
                                                              vision_token_ids=self.vision_ids))
        return out

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample], dummy: TrainSample) -> None:
        """Each sample's `ref_logp` under the frozen reference."""
        packs = self.packs(samples)
        n = len(packs)
        if getattr(self.reference, "collective", False):  # the sharded policy's forward: same count on every rank
            (n,) = all_reduce_max([len(packs)], self.device)
        scored: list[tuple[Sequence[TrainSample], torch.Tensor]] = []
        with self.reference.on_device():
            for i in range(n):
                group = packs[i] if i < len(packs) else [dummy]
                batch = self._pack(group)
                batch.pop("routes", None)  # the reference routes by itself
                logp = self.reference.token_logprobs(batch)
                if i < len(packs):
                    scored.append((group, logp))
            for (done, _), pieces in zip(scored, to_host_pieces(scored)):  # one read after the pass
                for s, piece in zip(done, pieces):
                    s.ref_logp = piece

    @torch.no_grad()
    def recompute_old_logprobs(self, samples: Sequence[TrainSample], dummy: TrainSample) -> None:
        """Each sample's `old_logp` under the current weights (eval mode: no dropout)."""
        packs = self.packs(samples)
        (n,) = all_reduce_max([len(packs)], self.device)
        self.bundle.wrapper.eval()
        scored: list[tuple[Sequence[TrainSample], torch.Tensor]] = []
        for i in range(n):
            group = packs[i] if i < len(packs) else [dummy]
            batch = self._pack(group)
            with self.replay_scope(batch, count=i < len(packs)):
                logp = self.bundle.wrapper(batch, temperature=self.rl.rollout.temperature, **self.mask_kw)
            if i < len(packs):
                scored.append((group, logp))
        for (done, _), pieces in zip(scored, to_host_pieces(scored)):  # one read after the pass
            for s, piece in zip(done, pieces):
                s.old_logp = piece

    # ------------------------------------------------------------------ updates
    def update(self, step: int, samples: list[TrainSample], dummy: TrainSample, *,
               proximal_from_forward: bool = False) -> UpdateResult:
        """The optimizer updates of one step. `proximal_from_forward` (a single update): each sample's old_logp is
        set from this forward's detached log-probs before the loss (the proximal policy = the current weights)."""
        r, wrapper, optimizer = self.rl, self.bundle.wrapper, self.optim.optimizer
        balancer = getattr(self.bundle, "moe_balancer", None)  # None without MoE layers (and on light test bundles)
        # on the device, added pack by pack in order (as the Python floats they replace), read with each update's
        # loss and norm (`read_update`): token-weighted sums of the loss metrics over this rank's micro-batches, their
        # weights, sum |log pi - log pi_rollout| of the first mini-batch
        dev_sums: dict[str, torch.Tensor] = {}
        dev_weights: dict[str, torch.Tensor] = {}
        dev_diff = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        losses: list[float] = []
        grad_norms: list[float] = []
        diff_sum = diff_n = 0.0
        train_tokens = 0
        updates = 0
        dp = self.shards.world
        for epoch in range(r.batch.ppo_epochs):
            order = list(range(len(samples)))
            random.Random(((self.seed * 1_000_003 + step) * 131 + epoch) * 8191 + self.shards.rank).shuffle(order)
            for m in range(r.batch.mini_batches_per_step):
                mb = [samples[i] for i in order[m::r.batch.mini_batches_per_step]]
                # the normaliser counts every sample of the mini-batch, the forwards skip zero-advantage ones
                packs = self.packs([s for s in mb if self.trains(s)])
                g_tokens, g_seqs, g_packs = self.shards.sum([sum(s.response_length for s in mb), len(mb), len(packs)])
                (n_packs,) = all_reduce_max([len(packs)], self.device)
                if g_tokens == 0:
                    continue  # every group of this mini-batch was dropped on every rank
                # nothing left to forward anywhere (all advantages 0): one dummy forward, so every parameter gets
                # its zero gradient and the optimizer steps (momentum, weight decay) as it would have
                n_packs = max(n_packs, 1)
                normalizer = {"token-mean": g_tokens, "seq-mean": g_seqs}.get(r.loss.loss_agg, g_seqs * r.rollout.max_new_tokens)
                loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
                proximal: list[tuple[Sequence[TrainSample], torch.Tensor]] = []  # old_logp of this update's forwards
                for i in range(n_packs):
                    is_real = i < len(packs)
                    group = packs[i] if is_real else [dummy]
                    batch = self._pack(group)
                    with self.replay_scope(batch, count=is_real and epoch == 0 and m == 0 and not self._routes_counted):
                        # a filler forward's tokens do not count as expert loads (correction biases, moe/* metrics)
                        filler = not is_real and balancer is not None
                        with uncounted_expert_load(self.bundle.model) if filler else contextlib.nullcontext():
                            logp, ent = wrapper(batch, temperature=r.rollout.temperature, return_entropy=True,
                                                **self.mask_kw)
                        # MoE auxiliary loss of this forward (None without MoE layers or aux_loss_coef = 0), a mean
                        # over the mini-batch's packs, every rank's (x dp: FSDP averages), as the SFT loop averages
                        # over micro-batches: its weights sum to 1 however unevenly the ranks' packs fall
                        aux = balancer.aux_loss() if balancer is not None else None
                        if not is_real:
                            (logp.sum() * 0.0 + (aux * 0.0 if aux is not None else 0.0)).backward()
                            continue
                        train_tokens += int(batch["input_ids"].numel())
                        old = None
                        if proximal_from_forward:  # the samples' old_logp: these values, on the host after the read
                            old = logp.detach().float()
                            proximal.append((group, old))
                        out = self.loss(logp, ent, group, normalizer, old=old)
                        total_loss = out.loss * dp
                        if aux is not None:
                            total_loss = total_loss + aux * dp / g_packs
                        total_loss.backward()
                        loss_sum = loss_sum + out.loss.detach().double()
                        n_tok = out.num_tokens.double()
                        for k, v in out.metrics.items():
                            if k != "pg_loss" and not k.startswith("mismatch_"):  # mismatch: once per step, in train()
                                dev_sums[k] = dev_sums.get(k, torch.zeros_like(n_tok)) + v.double() * n_tok
                                dev_weights[k] = dev_weights.get(k, torch.zeros_like(n_tok)) + n_tok
                        if epoch == 0 and m == 0:  # the policy before any update of this step vs the rollout's numbers
                            behav = torch.cat([s.behav_logp for s in group]).to(logp.device, non_blocking=True)
                            dev_diff = dev_diff + (logp.detach().float() - behav).abs().sum().double()
                            diff_n += float(behav.numel())
                norm = clip_grad_norm_(self.bundle.trainable_params, self.max_grad_norm)
                keys = list(dev_sums)
                running = [*(dev_sums[k] for k in keys), *(dev_weights[k] for k in keys), dev_diff]
                tail = torch.cat([v.reshape(-1) for _, v in proximal]) if proximal else None
                local, everyone, grad_norm, values, old_host = read_update(loss_sum, norm, running, tail)
                sums = dict(zip(keys, values[:len(keys)]))
                weights = dict(zip(keys, values[len(keys):2 * len(keys)]))
                diff_sum = values[-1]
                if old_host is not None:
                    start = 0
                    for done, v in proximal:
                        for s, piece in zip(done, split_by_response(old_host[start:start + v.numel()].float(), done)):
                            s.old_logp = piece
                        start += v.numel()
                grad_norms.append(grad_norm)
                # non-finite (this rank's loss, or another's: the sum over the ranks): skip, count
                if self.guard.allow(everyone, grad_norm, step=step + 1, loss_is_global=True):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(local)
                updates += 1
        lr = self.optim.scheduler.get_last_lr()[0]  # the lr of this step's updates (step() moves to the next)
        self.optim.scheduler.step()
        # MoE load balancing once per GRPO step, as the SFT loop does per optimizer step: the loads of
        # all this step's training forwards (summed over ranks) move the score-correction biases, and
        # every n_step_per_workload_report steps the moe/* metrics and the expert-load table are reported
        moe_report = balancer.after_step(step + 1) if balancer is not None else None
        if moe_report is not None and self.metrics_logger is not None:
            self.metrics_logger.log_moe_table(step + 1, moe_report[1])
        return UpdateResult(lr=lr, moe=moe_report[0] if moe_report is not None else None, sums=sums, weights=weights,
                            losses=losses, grad_norms=grad_norms, updates=updates, diff=(diff_sum, diff_n),
                            train_tokens=train_tokens)

    def hold(self, step: int) -> UpdateResult:
        """A step without policy updates (the critic's warm-up): the scheduler still moves on."""
        lr = self.optim.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step: meant here
            warnings.simplefilter("ignore", UserWarning)
            self.optim.scheduler.step()
        return UpdateResult(lr=lr, moe=None, sums={}, weights={}, losses=[], grad_norms=[], updates=0, diff=(0.0, 0.0),
                            train_tokens=0)

    def loss(self, logp: torch.Tensor, ent: torch.Tensor, group: Sequence[TrainSample], normalizer: float, *,
             old: Optional[torch.Tensor] = None) -> PolicyLossOutput:
        """The policy loss of one packed micro-batch (its share of the mini-batch's normaliser). Its per-token inputs
        are made on the host (the samples hold them there) and moved without waiting for the device (module
        docstring). `old`: the old log-probs on the device already (the update's own forward's, the proximal policy);
        else the samples' `old_logp`."""
        r = self.rl
        dev = logp.device

        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, non_blocking=True)

        lengths = torch.tensor([s.response_length for s in group])
        if self.critic is not None or self.batch_advantages is not None:  # per-token advantages (GAE, REINFORCE++)
            adv = _cat([s.token_advantages for s in group], "token_advantages")
        else:
            adv = torch.repeat_interleave(torch.tensor([s.advantage for s in group]), lengths)
        adv = move(adv.to(logp.dtype), dev)  # with seq_ids' host copy: GSPO checks it on the host
        if old is None:
            old = moved(_cat([s.old_logp for s in group], "old_logp"))
        ref = moved(_cat([s.ref_logp for s in group], "ref_logp")) if self.reference is not None else None
        seq_ids = move(torch.repeat_interleave(torch.arange(len(group)), lengths), dev)  # the segment count: on the host
        mask = keep_host_copy(torch.ones_like(logp, dtype=torch.bool), torch.ones(logp.shape, dtype=torch.bool))
        rollout = moved(torch.cat([s.behav_logp for s in group])) if r.loss.rollout_correction != "none" else None
        behav = moved(torch.cat([s.behav_logp for s in group])) if self.decoupled else None
        return compute_policy_loss(self.loss_spec, logp, old, adv, mask, seq_ids=seq_ids,
                                   normalizer=float(normalizer), ref_logp=ref, entropy=ent, rollout_logp=rollout,
                                   behav_logp=behav)
