"""`Critic`: PPO's value function inside a step — the values of the step's samples, their GAE advantages and
returns, and the critic's own optimizer updates.

Order within a step (PolicyUpdate.train): reference / old log-probs, then `prepare` (the critic's values of the
rollout, V_old, in eval mode; token rewards with the KL penalty; GAE; whitening), then the policy's updates
(unless the critic is still warming up), then `update` (the critic's `rl.batch.ppo_epochs` x
`rl.batch.mini_batches_per_step` updates on the same mini-batches, in the same order as the policy's).

Data parallelism: the critic is a plain module replicated on every rank (no FSDP: its forwards need no
collective, so ranks may run different numbers of packs); after each mini-batch the gradients are summed over
the data shards (the loss is normalised by the mini-batch's global token / sequence count, so the sum is the
one-process gradient). Whitening uses the step's global mean and variance.

MoE backbones are balanced as the policy is (`[moe]`): the auxiliary loss joins the value loss, averaged over the
packs and shards, and the step's expert loads move the critic's own score-correction biases once per step
(`critic/moe/*` metrics on the report steps). Everything is a function of the
samples, the weights and (seed, step, epoch, rank), so a resumed run repeats the uninterrupted one.

Host reads (each a stream sync on CUDA): the values of a pass come to the host once, after its last pack; an update
reads its loss sum, gradient norm and running metric sums once, before its optimizer step (`read_update`).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_vlm.host_copies import keep_host_copy, move
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS
from megatron_vlm.rl.algorithms.value_losses import VALUE_LOSSES
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.rewards import step_token_rewards
from megatron_vlm.rl.critic.value_model import ValueModel
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.policy_update import read_update, to_host_pieces

__all__ = ["Critic", "resolved_gae"]

WHITEN_EPS = 1e-8

Packs = Callable[[Sequence[TrainSample]], list[list[TrainSample]]]
ToBatch = Callable[[Sequence[TrainSample]], dict]


def resolved_gae(rl: Any) -> tuple[float, float]:
    """(gamma, lam) of `[rl.advantages]`, their defaults where unset."""
    from megatron_vlm.rl.algorithms.advantage_estimators import GAE_DEFAULT_GAMMA, GAE_DEFAULT_LAM

    adv = rl.advantages
    return (GAE_DEFAULT_GAMMA if adv.gamma is None else float(adv.gamma),
            GAE_DEFAULT_LAM if adv.lam is None else float(adv.lam))


def _cat(pieces: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The samples' per-token tensors concatenated (empty float32 without samples; each must be set)."""
    present = [p for p in pieces if p is not None]
    assert len(present) == len(pieces), "a sample's per-token tensor is not set"
    return torch.cat(present) if present else torch.zeros(0, dtype=torch.float32)


def _aligned(pieces: Sequence[Optional[torch.Tensor]], lengths: Sequence[int], what: str) -> torch.Tensor:
    """The samples' per-token tensors concatenated, each checked against its sample's response length first: the
    batched GAE sees only the concatenation, where one sample's value too many and the next one's too few add up
    to the right total and shift every later value onto another token. Shapes only: no host read."""
    for i, (p, n) in enumerate(zip(pieces, lengths)):
        if p is None or p.numel() != n:
            got = "no values" if p is None else f"{p.numel()} values"
            raise ValueError(f"{what}: sample {i} of the step has {got} for its {n} response tokens (the critic's "
                             "values must be one per response token of each sample)")
    return _cat(pieces)


class Critic:
    """`model`: the `ValueModel`; `optimizer`: its own AdamW; `rl`: the `[rl]` section; `shards`: the data
    shards; `max_grad_norm`, `seed`: train.max_grad_norm, train.seed; `balancer`: the MoE load balancer of the
    backbone's MoE blocks (training/moe_balancing.py; None without)."""

    def __init__(self, model: ValueModel, optimizer: torch.optim.Optimizer, rl: Any, *, shards: DataShards,
                 max_grad_norm: float, seed: int, balancer: Optional[Any] = None):
        self.model, self.optimizer, self.rl, self.shards = model, optimizer, rl, shards
        self.balancer = balancer
        """The backbone's `MoELoadBalancer` (None without MoE blocks)."""
        self.max_grad_norm, self.seed = max_grad_norm, seed
        self.cfg = rl.critic
        self.gamma, self.lam = resolved_gae(rl)
        self.estimator = ADVANTAGE_ESTIMATORS.get(rl.advantage)
        assert self.estimator.token_fn is not None, f"{rl.advantage!r} is not a token estimator"
        self.whiten = rl.advantages.normalize_std is not False  # the estimator's default: whiten
        self.value_loss = VALUE_LOSSES.get(self.cfg.value_loss)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = next(model.parameters()).device
        self.skipped = 0
        """Critic updates skipped for a non-finite loss or gradient norm."""

    def policy_moves(self, step: int) -> bool:
        """Whether the policy is updated at step `step` (0-based): not during `critic.warmup_steps`."""
        return step >= self.cfg.warmup_steps

    # ------------------------------------------------------------------ values and advantages
    @torch.no_grad()
    def values(self, samples: Sequence[TrainSample], packs: Packs, to_batch: ToBatch) -> None:
        """Each sample's `old_values` under the current critic (eval mode: no dropout)."""
        self.model.eval()
        scored = [(group, self.model(to_batch(group))) for group in packs(samples)]
        for (group, _), pieces in zip(scored, to_host_pieces(scored)):  # one read after the pass
            for s, piece in zip(group, pieces):
                s.old_values = piece

    def prepare(self, samples: Sequence[TrainSample], packs: Packs, to_batch: ToBatch) -> dict[str, float]:
        """V_old, token rewards, GAE advantages and returns of every sample (whitened over the step's tokens
        unless advantages.normalize_std = false); the step's critic/* and advantage/* metrics."""
        self.values(samples, packs, to_batch)
        lengths = [s.response_length for s in samples]
        r, kl_sum = step_token_rewards([s.score for s in samples], lengths, old_logp=[s.old_logp for s in samples],
                                       ref_logp=[s.ref_logp for s in samples], kl_coef=self.rl.loss.kl_coef,
                                       kl_estimator=self.rl.loss.kl_estimator)
        v_flat = _aligned([s.old_values for s in samples], lengths, "old_values")
        adv_flat, ret_flat = self._gae(r, v_flat, lengths)
        for s, adv, ret in zip(samples, adv_flat.split(lengths), ret_flat.split(lengths)):
            s.token_advantages, s.returns = adv, ret
        a, v, ret_all = adv_flat.double(), v_flat.double(), ret_flat.double()
        err = ret_all - v
        # host tensors (the values came to the host with the pass): one read of all the sums
        local = torch.stack([x.sum() for x in (a, a * a, ret_all, ret_all * ret_all, err, err * err, v)]).tolist()
        n, a1, a2, r1, r2, e1, e2, v1, klsum = self.shards.sum([a.numel(), *local, kl_sum])
        out: dict[str, float] = {}
        if n == 0:
            return out
        mean = a1 / n
        var = max(a2 - a1 * a1 / n, 0.0) / max(n - 1, 1)  # unbiased, as verl's masked_whiten
        final = a
        if self.whiten:
            scale = 1.0 / math.sqrt(var + WHITEN_EPS)
            whitened = ((a - mean) * scale).float()
            for s, piece in zip(samples, whitened.split(lengths)):
                s.token_advantages = piece
            final = whitened.double()
        f1, f2 = self.shards.sum(torch.stack([final.sum(), (final * final).sum()]).tolist())
        lo, hi = self._extremes(final)
        ret_var = max(r2 - r1 * r1 / n, 0.0) / n
        err_var = max(e2 - e1 * e1 / n, 0.0) / n
        out.update({"advantage/mean": f1 / n, "advantage/std": math.sqrt(max(f2 - f1 * f1 / n, 0.0) / max(n - 1, 1)),
                    "advantage/min": lo, "advantage/max": hi,
                    "critic/values_old_mean": v1 / n, "critic/returns_mean": r1 / n,
                    "critic/explained_var": 1.0 - err_var / ret_var if ret_var > 0 else 0.0,
                    "critic/kl_in_reward": klsum / n})
        return out

    def _gae(self, rewards: torch.Tensor, values: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) of the step's concatenated [sum(lengths)] rewards and values, as one right-padded
        [samples, longest] batch: the estimator's recursion over the positions is a Python loop of a few tensor ops
        per position (~10 us), so a call per sample cost samples x length of them, one call of the batch only its
        longest response. Each row equals its sample's own call bit for bit (element-wise ops; a padded position
        after a row's last token leaves the recursion's zero start as it is). `values` must be aligned per sample
        (`_aligned` checks each sample's count; only the total can be checked here)."""
        if values.numel() != sum(lengths) or rewards.numel() != sum(lengths):
            raise ValueError(f"old_values / rewards: {values.numel()} / {rewards.numel()} entries for "
                             f"{sum(lengths)} response tokens")
        if not lengths:
            return values.clone(), values.clone()
        n_seq, width = len(lengths), max(lengths)
        counts = torch.tensor(lengths, dtype=torch.long)
        ids = torch.repeat_interleave(torch.arange(n_seq), counts, output_size=values.numel())
        pos = torch.arange(values.numel()) - (torch.cumsum(counts, 0) - counts)[ids]
        r, v = (x.new_zeros(n_seq, width).index_put_((ids, pos), x) for x in (rewards, values))
        mask = torch.zeros(n_seq, width, dtype=torch.bool).index_put_((ids, pos), torch.ones((), dtype=torch.bool))
        assert self.estimator.token_fn is not None
        adv, ret = self.estimator.token_fn(r, v, mask, gamma=self.gamma, lam=self.lam, seq_ids=None)
        return adv[ids, pos], ret[ids, pos]

    def _extremes(self, x: torch.Tensor) -> tuple[float, float]:
        """Global min and max over the data shards (0, 0 without tokens anywhere)."""
        parts = self.shards.gather((float(x.min()), float(x.max())) if x.numel() else (math.inf, -math.inf))
        lo, hi = min(p[0] for p in parts), max(p[1] for p in parts)
        return (0.0, 0.0) if lo == math.inf else (lo, hi)

    # ------------------------------------------------------------------ updates
    def update(self, step: int, samples: Sequence[TrainSample], packs: Packs, to_batch: ToBatch) -> dict[str, float]:
        """The critic's optimizer updates of step `step` (the policy's epochs and mini-batches, the same order);
        its critic/* metrics."""
        r = self.rl
        self.model.train()
        sums: dict[str, float] = {}
        dev_sums: dict[str, torch.Tensor] = {}  # on the device, read with each update's loss and norm
        weight = 0.0
        grad_norms: list[float] = []
        for epoch in range(r.batch.ppo_epochs):
            order = list(range(len(samples)))
            random.Random(((self.seed * 1_000_003 + step) * 131 + epoch) * 8191 + self.shards.rank).shuffle(order)
            for m in range(r.batch.mini_batches_per_step):
                mb = [samples[i] for i in order[m::r.batch.mini_batches_per_step]]
                groups = packs(mb)
                g_tokens, g_seqs, g_packs = self.shards.sum([sum(s.response_length for s in mb), len(mb), len(groups)])
                if g_tokens == 0:
                    continue
                normalizer = {"token-mean": g_tokens, "seq-mean": g_seqs}.get(r.loss.loss_agg,
                                                                              g_seqs * r.rollout.max_new_tokens)
                loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
                for group in groups:
                    values = self.model(to_batch(group))
                    loss, metrics = self._loss(values, group, float(normalizer))
                    aux = self.balancer.aux_loss() if self.balancer is not None else None
                    # the MoE auxiliary loss, a mean over the mini-batch's packs of every shard (gradients summed)
                    (loss if aux is None else loss + aux / g_packs).backward()
                    loss_sum = loss_sum + loss.detach().double()
                    n_tok = float(values.numel())
                    for k, v in metrics.items():
                        if k != "value_loss":
                            dev_sums[k] = dev_sums.get(k, torch.zeros_like(loss_sum)) + v.detach().double() * n_tok
                    weight += n_tok
                local, norm, values_read = self._step(loss_sum, list(dev_sums.values()))
                sums.update(zip(dev_sums, values_read))
                sums["value_loss"] = sums.get("value_loss", 0.0) + local
                grad_norms.append(norm)
        # summed by name, not by position: a rank without samples in this step (its groups dropped, or its completions
        # masked as truncated) ran no forward and holds no metric but value_loss
        total_weight, totals = 0.0, dict[str, float]()
        for part_weight, part in self.shards.gather((weight, sums)):
            total_weight += part_weight
            for k, v in part.items():
                totals[k] = totals.get(k, 0.0) + v
        out = {f"critic/{k}": (v / total_weight if k != "value_loss" else v) for k, v in sorted(totals.items())
               if total_weight > 0}
        if "critic/value_loss" in out:  # the mean over the updates that ran (a mini-batch without tokens runs none)
            out["critic/value_loss"] /= max(len(grad_norms), 1)
        out["critic/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        out["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["critic/skipped_updates"] = float(self.skipped)
        report = self.balancer.after_step(step + 1) if self.balancer is not None else None
        if report is not None:
            out.update({f"critic/{k}": v for k, v in report[0].items()})
        return out

    def _loss(self, values: torch.Tensor, group: Sequence[TrainSample],
              normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = values.device  # the per-token inputs are made on the host and moved without waiting (no sync)
        old = torch.cat([s.old_values for s in group]).to(dev, non_blocking=True)  # type: ignore[misc]
        ret = torch.cat([s.returns for s in group]).to(dev, non_blocking=True)  # type: ignore[misc]
        lengths = torch.tensor([s.response_length for s in group])
        seq_ids = move(torch.repeat_interleave(torch.arange(len(group)), lengths), dev)  # the segment count: on the host
        mask = keep_host_copy(torch.ones_like(values, dtype=torch.bool), torch.ones(values.shape, dtype=torch.bool))
        return self.value_loss(values, old, ret, mask, clip_range=self.cfg.value_clip or None,
                               loss_agg=self.rl.loss.loss_agg, seq_ids=seq_ids, normalizer=normalizer,
                               max_response_length=self.rl.rollout.max_new_tokens)

    def _step(self, loss_sum: torch.Tensor, running: list[torch.Tensor]) -> tuple[float, float, list[float]]:
        """Sum the gradients over the data shards, clip, step (skipped and counted when not finite); (this rank's
        loss sum, the gradient norm, `running`) as read with the norm, in one read."""
        if self.shards.world > 1 and dist.is_available() and dist.is_initialized():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                if self.shards.copies > 1:
                    p.grad.div_(self.shards.copies)
        grad_norm = clip_grad_norm_(self.params, self.max_grad_norm)  # train.max_grad_norm = 0: only measured
        local, loss_total, norm, values, _ = read_update(loss_sum, grad_norm, running)
        if math.isfinite(norm) and math.isfinite(loss_total):
            self.optimizer.step()
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return local, norm, values
