"""Policy-gradient losses by name (`[rl] policy_loss`), the frozen spec built once from the config, and the
loss of one micro-batch (`compute_policy_loss`).

One function per variant computes the per-token policy-gradient term from the log-ratio (the variants'
equations are in the module docstring of `megatron_vlm.rl.losses`); what every variant shares — the
rollout / training mismatch correction (TIS / MIS), the decoupled behaviour weighting of asynchronous
training, the aggregation, the KL penalty, the entropy bonus and the metrics — is applied around it here.

Adding a variant: a function with the `PolicyLossFn` signature, decorated with
`@POLICY_LOSSES.register("name")`; `[rl] policy_loss = "name"` then selects it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.host_copies import all_on_host, keep_host_copy, on_host
from megatron_vlm.rl.algorithms.loss_terms import (
    LOG_RATIO_CLAMP,
    LOSS_AGGS,
    ROLLOUT_CORRECTIONS,
    aggregate_loss,
    kl_penalty,
    masked_mean,
    rollout_correction_mask,
    seg_mean,
    segments,
)
from megatron_vlm.rl.algorithms.registry import Registry
from megatron_vlm.table_checks import at_least

__all__ = ["POLICY_LOSSES", "PolicyLossFn", "PolicyTerms", "PolicyLossSpec", "PolicyLossOutput", "compute_policy_loss"]


@dataclass
class PolicyTerms:
    """A variant's per-token output."""
    pg: torch.Tensor
    """Per-token policy-gradient loss (before the TIS / behaviour weights and the aggregation)."""
    ratio: torch.Tensor
    """The ratio the variant clips (token or sequence ratio placed on every token): `ratio_mean`."""
    clipped: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


class PolicyLossFn(Protocol):
    """`(logp, log_ratio, adv, mask, seq_ids, lo, hi) -> PolicyTerms`: `log_ratio` = clamp(logp - old_logp),
    `adv` broadcast to logp and detached, `mask` the trained tokens (after MIS), [lo, hi] the clip range."""

    def __call__(self, logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 seq_ids: Optional[torch.Tensor], lo: float, hi: float) -> PolicyTerms: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "policy_loss")


def _clipped_surrogate(adv: torch.Tensor, ratio: torch.Tensor, lo: float, hi: float) -> PolicyTerms:
    """PPO's pessimistic clipped surrogate max(-A r, -A clip(r, lo, hi)) of a (token or sequence) ratio."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(lo, hi)
    return PolicyTerms(pg=torch.maximum(pg_unclipped, pg_clipped), ratio=ratio,
                       clipped=pg_clipped.detach() > pg_unclipped.detach(),
                       clipped_low=(adv < 0) & (ratio.detach() < lo), clipped_high=(adv > 0) & (ratio.detach() > hi))


@POLICY_LOSSES.register("clip")
def clip_loss(logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              seq_ids: Optional[torch.Tensor], lo: float, hi: float) -> PolicyTerms:
    """PPO / GRPO: the clipped token ratio (separate low / high ranges: DAPO's clip-higher)."""
    return _clipped_surrogate(adv, torch.exp(log_ratio), lo, hi)


def _one_advantage_per_sequence_on_host(adv: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> bool:
    """Whether the host copies of a packed layout's advantages and sequence ids show one value per sequence at every
    position of a sequence (masked or not: enough for GSPO's check of the masked ones); False when not known on the
    host. The trainers make both there (one advantage per sample, repeated): the check then reads no device value."""
    host = all_on_host(adv, seq_ids) if seq_ids is not None and adv.shape == seq_ids.shape else None
    if host is None:
        return False
    a, ids = host
    assert a is not None and ids is not None
    ids, a = ids.long().reshape(-1), a.reshape(-1)
    ids, a = ids[ids >= 0], a[ids >= 0]  # a negative id is no masked position's (`segments` checks)
    if a.numel() == 0:
        return True
    first = torch.zeros(int(ids.max()) + 1, dtype=torch.long).scatter_reduce(
        0, ids, torch.arange(ids.numel()), "amin", include_self=False)  # each sequence's first position
    return bool((a == a[first[ids]]).all())


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              seq_ids: Optional[torch.Tensor], lo: float, hi: float) -> PolicyTerms:
    """GSPO: the sequence ratio exp(mean_t log r_t), clipped per sequence; one advantage per sequence."""
    idx, n_seq = segments(mask, seq_ids, "variant='gspo'")
    seq_log_ratio, _ = seg_mean(log_ratio, mask, idx, n_seq)
    if not _one_advantage_per_sequence_on_host(adv, seq_ids):  # not shown on the host: the device decides
        seq_adv, _ = seg_mean(adv, mask, idx, n_seq)
        dev = ((adv - seq_adv[idx]).abs() * mask).max() if mask.any() else adv.new_zeros(())
        if float(dev) > 1e-6 * (1.0 + float(seq_adv.abs().max())):
            raise ValueError("advantages: variant 'gspo' takes one advantage per sequence; these vary within a "
                             "sequence (use variant 'gspo_token' for per-token advantages)")
    return _clipped_surrogate(adv, torch.exp(seq_log_ratio)[idx], lo, hi)  # differentiable through every token


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    seq_ids: Optional[torch.Tensor], lo: float, hi: float) -> PolicyTerms:
    """GSPO-token: the value of the sequence ratio, the gradient of the token's own log-prob."""
    idx, n_seq = segments(mask, seq_ids, "variant='gspo_token'")
    seq_log_ratio, _ = seg_mean(log_ratio, mask, idx, n_seq)
    return _clipped_surrogate(adv, torch.exp(seq_log_ratio.detach())[idx] * torch.exp(logp - logp.detach()), lo, hi)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               seq_ids: Optional[torch.Tensor], lo: float, hi: float) -> PolicyTerms:
    """CISPO: -sg[clip(r_t)] A_t log pi_t; every token keeps its gradient."""
    ratio = torch.exp(log_ratio)
    w = ratio.detach().clamp(lo, hi)
    clipped_low, clipped_high = ratio.detach() < lo, ratio.detach() > hi
    return PolicyTerms(pg=-adv * w * logp, ratio=ratio, clipped=clipped_low | clipped_high, clipped_low=clipped_low,
                       clipped_high=clipped_high)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar loss to backpropagate: policy-gradient term + kl_coef * KL term - entropy_coef * entropy."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached scalars, means over the masked tokens of this call (reduce across micro-batches /
    ranks weighted by `num_tokens`): pg_loss, clip_frac, clip_frac_low, clip_frac_high,
    ratio_mean, and when available kl, entropy, behav_imp_weight, behav_capped_frac,
    tis_weight_mean, tis_capped_frac, mis_dropped_frac, mismatch_kl, mismatch_ratio_{min,mean,max}
    (min / max are extremes, not means: reduce them with min / max)."""
    num_tokens: torch.Tensor = None  # type: ignore[assignment]
    """Number of masked (trained) tokens in this call (after MIS drops)."""


@dataclass(frozen=True)
class PolicyLossSpec:
    """Every setting of the policy loss, validated once when built (`from_config` per run, or per call of the
    public `policy_loss`); `compute_policy_loss` then only checks the tensors it is given."""
    clip_ratio_low: float
    clip_ratio_high: float
    loss_agg: str = "token-mean"
    variant: str = "clip"
    max_response_length: Optional[int] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    behav_imp_weight_cap: Optional[float] = None
    entropy_coef: float = 0.0
    rollout_correction: str = "none"
    rollout_correction_cap: Optional[float] = None

    def __post_init__(self) -> None:
        if self.variant not in POLICY_LOSSES:
            raise ValueError(f"variant: must be one of {tuple(POLICY_LOSSES.names())}, got {self.variant!r}")
        if self.clip_ratio_low < 0 or self.clip_ratio_low >= 1 or self.clip_ratio_high < 0:
            raise ValueError(f"clip ratios: need 0 <= low < 1 and high >= 0, got low={self.clip_ratio_low}, "
                             f"high={self.clip_ratio_high}")
        at_least(self, 0, "kl_coef", "entropy_coef")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg: must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction: must be one of {ROLLOUT_CORRECTIONS}, got {self.rollout_correction!r}")
        if self.rollout_correction != "none" and (self.rollout_correction_cap is None or self.rollout_correction_cap <= 1):
            raise ValueError(f"rollout_correction_cap: must be > 1, got {self.rollout_correction_cap}")

    @classmethod
    def from_config(cls, rl: Any, *, decoupled: bool) -> PolicyLossSpec:
        """The loss of a GRPO run's `[rl]` section; `decoupled`: asynchronous GRPO with stale samples (the
        behaviour weight, capped by `behav_imp_weight_cap`)."""
        return cls(clip_ratio_low=rl.loss.clip_ratio_low, clip_ratio_high=rl.loss.clip_ratio_high, loss_agg=rl.loss.loss_agg,
                   variant=rl.policy_loss, kl_coef=rl.loss.kl_coef, kl_estimator=rl.loss.kl_estimator, entropy_coef=rl.loss.entropy_coef,
                   rollout_correction=rl.loss.rollout_correction, rollout_correction_cap=rl.loss.rollout_correction_cap,
                   behav_imp_weight_cap=rl.loss.behav_imp_weight_cap if decoupled else None)


def _check_inputs(spec: PolicyLossSpec, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, named: dict[str, Optional[torch.Tensor]]) -> torch.Tensor:
    """Shapes and dtypes of one call; the advantages broadcast to logp, detached."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: must be a bool tensor, got {mask.dtype}")
    if advantages.dim() == logp.dim() - 1 and logp.dim() == 2:
        advantages = advantages[:, None]
    try:
        adv = torch.broadcast_to(advantages.detach().to(logp.dtype), logp.shape)
    except RuntimeError:
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} does not broadcast to logp {tuple(logp.shape)}") from None
    host = on_host(advantages)
    if host is not advantages and host.shape == adv.shape:  # kept reachable: GSPO checks the advantages on the host
        keep_host_copy(adv, host.to(adv.dtype))
    for name, t in named.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must equal logp's {tuple(logp.shape)}")
    if spec.rollout_correction != "none":
        if named["rollout_logp"] is None:
            raise ValueError(f"rollout_logp: required by rollout_correction={spec.rollout_correction!r}")
        if named["behav_logp"] is not None:
            raise ValueError("behav_logp: the decoupled weighting exp(old - behav) already is the rollout ratio; "
                             "do not combine it with rollout_correction")
    if named["behav_logp"] is None and spec.behav_imp_weight_cap is not None:
        raise ValueError("behav_imp_weight_cap: only meaningful with behav_logp (the decoupled loss)")
    if named["ref_logp"] is None and spec.kl_coef > 0:
        raise ValueError("ref_logp: required when kl_coef > 0")
    if named["entropy"] is None and spec.entropy_coef > 0:
        raise ValueError("entropy: required when entropy_coef > 0")
    return adv


def _mismatch(spec: PolicyLossSpec, old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
              seq_ids: Optional[torch.Tensor], metrics: dict[str, torch.Tensor],
              dtype: torch.dtype) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Mismatch metrics and the correction: (TIS token weights or None, the mask after MIS)."""
    token_w: Optional[torch.Tensor] = None
    with torch.no_grad():
        d = (old - rollout_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log rho
        rho = torch.exp(d)
        metrics["mismatch_kl"] = masked_mean(torch.exp(d) - d - 1.0, mask)  # k3 of KL(pi_rollout || pi_old)
        metrics["mismatch_ratio_mean"] = masked_mean(rho, mask)
        host = all_on_host(mask)
        if bool(host[0].any()) if host is not None and host[0] is not None else mask.any():
            # the extremes over the masked tokens (exact; a bool-mask index would read the count from the device)
            metrics["mismatch_ratio_min"] = torch.where(mask, rho, torch.full_like(rho, torch.inf)).min().float()
            metrics["mismatch_ratio_max"] = torch.where(mask, rho, torch.full_like(rho, -torch.inf)).max().float()
        cap = spec.rollout_correction_cap
        if spec.rollout_correction == "tis":
            assert cap is not None
            token_w = rho.clamp_max(cap).to(dtype)
            metrics["tis_capped_frac"] = masked_mean(rho > cap, mask)
            metrics["tis_weight_mean"] = masked_mean(token_w, mask)
        elif spec.rollout_correction == "mis":
            assert cap is not None
            kept = rollout_correction_mask(old, rollout_logp, mask, cap=cap, seq_ids=seq_ids)
            metrics["mis_dropped_frac"] = masked_mean(~kept, mask)  # share of tokens in dropped sequences
            mask = kept
    return token_w, mask


def compute_policy_loss(
    spec: PolicyLossSpec,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    behav_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    rollout_logp: Optional[torch.Tensor] = None,
) -> PolicyLossOutput:
    """The loss of `spec` on one micro-batch (inputs as `megatron_vlm.rl.losses.policy_loss` takes them)."""
    adv = _check_inputs(spec, logp, old_logp, advantages, mask, {"ref_logp": ref_logp, "behav_logp": behav_logp,
                                                                 "rollout_logp": rollout_logp, "entropy": entropy})
    metrics: dict[str, torch.Tensor] = {}
    old = old_logp.detach()
    token_w: Optional[torch.Tensor] = None
    if rollout_logp is not None:  # metrics whenever both log-probs are given, then the correction
        token_w, mask = _mismatch(spec, old, rollout_logp, mask, seq_ids, metrics, logp.dtype)

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    terms = POLICY_LOSSES.get(spec.variant)(logp, log_ratio, adv, mask, seq_ids,
                                            1.0 - spec.clip_ratio_low, 1.0 + spec.clip_ratio_high)
    pg = terms.pg
    if token_w is not None:
        pg = pg * token_w
    if behav_logp is not None:
        bw = torch.exp((old - behav_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).to(pg.dtype)
        if spec.behav_imp_weight_cap is not None:
            capped = bw > spec.behav_imp_weight_cap
            metrics["behav_capped_frac"] = masked_mean(capped, mask)
            bw = torch.where(capped, torch.zeros_like(bw), bw)
        metrics["behav_imp_weight"] = masked_mean(bw, mask)
        pg = pg * bw

    agg: dict[str, Any] = dict(seq_ids=seq_ids, normalizer=normalizer, max_response_length=spec.max_response_length)
    pg_loss = aggregate_loss(pg, mask, spec.loss_agg, **agg)  # type: ignore[arg-type]
    loss = pg_loss
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), spec.kl_estimator)  # type: ignore[arg-type]
        metrics["kl"] = masked_mean(kl, mask)
        if spec.kl_coef > 0:
            loss = loss + spec.kl_coef * aggregate_loss(kl, mask, spec.loss_agg, **agg)  # type: ignore[arg-type]
    if spec.entropy_coef > 0:
        assert entropy is not None
        loss = loss - spec.entropy_coef * aggregate_loss(entropy, mask, spec.loss_agg, **agg)  # type: ignore[arg-type]

    with torch.no_grad():
        metrics["pg_loss"] = pg_loss.detach().float()
        metrics["clip_frac"] = masked_mean(terms.clipped, mask)
        metrics["clip_frac_low"] = masked_mean(terms.clipped_low, mask)
        metrics["clip_frac_high"] = masked_mean(terms.clipped_high, mask)
        metrics["ratio_mean"] = masked_mean(terms.ratio, mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
    return PolicyLossOutput(loss=loss, metrics=metrics, num_tokens=mask.sum())
