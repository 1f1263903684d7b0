"""GRPO / PPO policy loss: clipped surrogate with separate low / high clip ranges, KL penalty
against a frozen reference model (k1 or k3 estimator), token-mean or sequence-mean aggregation,
and the decoupled (behaviour vs proximal policy) variant used by asynchronous training.

Inputs are per-token tensors of one shape — padded [B, T] rows or a packed [N] stream — with a
`mask` that is True on trained response tokens:

    logp        log pi_theta(token), differentiable (from kernels.linear_token_logprobs)
    old_logp    log-prob under the policy that the ratio is taken against: the rollout policy in
                synchronous GRPO; the *proximal* policy (recomputed before the update) in the
                decoupled variant
    advantages  per token (broadcastable to logp: a [B] per-sequence vector is expanded over T)
    ref_logp    reference model log-probs (only when kl_coef > 0)
    behav_logp  decoupled variant only: log-probs of the (possibly stale) behaviour policy that
                generated the sample; each token is weighted by pi_prox / pi_behav

Per token:  r = exp(logp - old_logp),  pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).
Aggregation: token-mean sums over tokens and divides by `normalizer` (default: the local count of
masked tokens; pass the global count when gradients are accumulated over micro-batches / ranks);
seq-mean averages each sequence over its own tokens, sums over sequences and divides by
`normalizer` (default: the local number of sequences with any masked token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

__all__ = ["PolicyLossOutput", "policy_loss", "kl_penalty", "aggregate_loss"]

# exp() of a log-ratio beyond +-20 overflows nothing in fp32 but produces astronomically large
# ratios that only appear with corrupted log-probs; the clamp keeps the loss finite (as verl does).
_LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar loss to backpropagate: policy-gradient term + kl_coef * KL term."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached scalars, means over the masked tokens of this call (reduce across micro-batches /
    ranks weighted by `num_tokens`): pg_loss, clip_frac, clip_frac_low, clip_frac_high,
    ratio_mean, and when available kl, entropy, behav_imp_weight, behav_capped_frac."""
    num_tokens: torch.Tensor = None  # type: ignore[assignment]
    """Number of masked (trained) tokens in this call."""


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref (unbiased, can be negative); k3 = exp(d) - d - 1 with
    d = log pi_ref - log pi (unbiased, always >= 0, lower variance; Schulman's "Approximating KL")."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator: must be 'k1' or 'k3', got {estimator!r}")


def _seq_index(mask: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> torch.Tensor:
    if seq_ids is not None:
        if seq_ids.shape != mask.shape:
            raise ValueError(f"seq_ids: shape {tuple(seq_ids.shape)} must equal the mask's {tuple(mask.shape)}")
        if seq_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seq_ids: must be an integer tensor, got {seq_ids.dtype}")
        if mask.any() and int(seq_ids[mask].min()) < 0:
            raise ValueError("seq_ids: masked tokens must have sequence ids >= 0")
        return seq_ids.long()
    if mask.dim() != 2:
        raise ValueError(
            f"loss_agg='seq-mean' on a {mask.dim()}-D (packed) layout needs seq_ids; rows of a 2-D [B, T] "
            "layout are taken as the sequences"
        )
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: Literal["token-mean", "seq-mean"],
    *,
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (see module docstring for the two modes)."""
    m = mask.to(per_token.dtype)
    if loss_agg == "token-mean":
        denom = m.sum() if normalizer is None else normalizer
        return (per_token * m).sum() / torch.clamp_min(torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device), 1.0)
    if loss_agg == "seq-mean":
        idx = _seq_index(mask, seq_ids)
        flat_idx = torch.where(mask, idx, torch.zeros_like(idx)).flatten()
        n_seq = int(flat_idx.max().item()) + 1 if flat_idx.numel() else 1
        tok_sum = torch.zeros(n_seq, dtype=per_token.dtype, device=per_token.device).index_add(0, flat_idx, (per_token * m).flatten())
        tok_cnt = torch.zeros(n_seq, dtype=per_token.dtype, device=per_token.device).index_add(0, flat_idx, m.flatten())
        present = tok_cnt > 0
        seq_mean = tok_sum[present] / tok_cnt[present]
        denom = present.sum() if normalizer is None else normalizer
        return seq_mean.sum() / torch.clamp_min(torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device), 1.0)
    raise ValueError(f"loss_agg: must be 'token-mean' or 'seq-mean', got {loss_agg!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(torch.float32)
    return (x.detach().float() * m).sum() / m.sum().clamp_min(1.0)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean",
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
    behav_logp: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    entropy: Optional[torch.Tensor] = None,
) -> PolicyLossOutput:
    """Clipped policy-gradient loss with optional KL penalty and decoupled behaviour weighting.

    With `behav_logp`, each token's clipped objective is multiplied by the (detached) importance
    weight w = exp(old_logp - behav_logp); tokens with w > behav_imp_weight_cap get weight 0 but stay
    in the normaliser (AReaL's decoupled PPO). Without it this is the standard synchronous loss.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: must be a bool tensor, got {mask.dtype}")
    if clip_ratio_low < 0 or clip_ratio_low >= 1 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios: need 0 <= low < 1 and high >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if advantages.dim() == logp.dim() - 1 and logp.dim() == 2:
        advantages = advantages[:, None]
    try:
        adv = torch.broadcast_to(advantages.detach().to(logp.dtype), logp.shape)
    except RuntimeError:
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} does not broadcast to logp {tuple(logp.shape)}") from None

    log_ratio = (logp - old_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)

    metrics: dict[str, torch.Tensor] = {}
    if behav_logp is not None:
        if behav_logp.shape != logp.shape:
            raise ValueError(f"behav_logp: shape {tuple(behav_logp.shape)} must equal logp's {tuple(logp.shape)}")
        w = torch.exp((old_logp.detach() - behav_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).to(pg.dtype)
        if behav_imp_weight_cap is not None:
            capped = w > behav_imp_weight_cap
            metrics["behav_capped_frac"] = _masked_mean(capped, mask)
            w = torch.where(capped, torch.zeros_like(w), w)
        metrics["behav_imp_weight"] = _masked_mean(w, mask)
        pg = pg * w
    elif behav_imp_weight_cap is not None:
        raise ValueError("behav_imp_weight_cap: only meaningful with behav_logp (the decoupled loss)")

    pg_loss = aggregate_loss(pg, mask, loss_agg, seq_ids=seq_ids, normalizer=normalizer)
    loss = pg_loss
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
    if ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp: shape {tuple(ref_logp.shape)} must equal logp's {tuple(logp.shape)}")
        kl = kl_penalty(logp, ref_logp.detach(), kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask)
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate_loss(kl, mask, loss_agg, seq_ids=seq_ids, normalizer=normalizer)
    elif kl_coef > 0:
        raise ValueError("ref_logp: required when kl_coef > 0")

    with torch.no_grad():
        metrics["pg_loss"] = pg_loss.detach().float()
        metrics["clip_frac"] = _masked_mean(pg_clipped > pg_unclipped, mask)
        metrics["clip_frac_low"] = _masked_mean((adv < 0) & (ratio < 1.0 - clip_ratio_low), mask)
        metrics["clip_frac_high"] = _masked_mean((adv > 0) & (ratio > 1.0 + clip_ratio_high), mask)
        metrics["ratio_mean"] = _masked_mean(ratio, mask)
        if entropy is not None:
            if entropy.shape != logp.shape:
                raise ValueError(f"entropy: shape {tuple(entropy.shape)} must equal logp's {tuple(logp.shape)}")
            metrics["entropy"] = _masked_mean(entropy, mask)
    return PolicyLossOutput(loss=loss, metrics=metrics, num_tokens=mask.sum())
