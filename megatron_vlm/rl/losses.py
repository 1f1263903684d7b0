"""GRPO / PPO policy losses: the clipped surrogate and the published variants that GRPO frameworks
offer with one key (`[rl] policy_loss`), the KL penalty against a frozen reference model, three
aggregations, an entropy bonus, rollout/training mismatch correction (TIS / MIS) and the decoupled
(behaviour vs proximal policy) weighting used by asynchronous training.

Inputs are per-token tensors of one shape — padded [B, T] rows or a packed [N] stream — with a
`mask` that is True on trained response tokens:

    logp         log pi_theta(token), differentiable (from kernels.linear_token_logprobs)
    old_logp     log-prob under the policy the ratio is taken against: the rollout policy in
                 synchronous GRPO, or the training-side recomputation of it (rl.recompute_logprobs);
                 the *proximal* policy in the decoupled variant
    advantages   per token (broadcastable to logp: a [B] per-sequence vector is expanded over T)
    seq_ids      packed layout only: the sequence of each token (rows are the sequences of [B, T])
    ref_logp     reference model log-probs (kl_coef > 0; also logged as `kl` when given)
    rollout_logp log-probs the rollout engine reported for the same tokens (mismatch correction)
    behav_logp   decoupled variant only: log-probs of the (possibly stale) behaviour policy

Variants (`variant=`, the strings of `[rl] policy_loss`); r_t = pi_theta / pi_old per token:

    clip        PPO / GRPO: per token max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), with
                separate low / high ranges (DAPO's "clip-higher", Yu et al. 2025).
    gspo        GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the sequence ratio
                s_i = exp(mean over the response of (logp - old_logp)) = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|),
                clipped per sequence: l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)).
                One advantage per sequence (a ValueError otherwise: use gspo_token). l_i is
                placed on every token of sequence i, so `seq-mean` gives the paper's mean over
                sequences and `token-mean` weights each sequence by its length.
                The paper's clip ranges are tiny because s_i is a per-token geometric mean:
                clip_ratio_low = 3e-4, clip_ratio_high = 4e-4 (not PPO's 0.2).
    gspo_token  GSPO-token (same paper): s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)] — the
                value of the sequence ratio with the gradient of the token — with per-token
                advantages, clipped per token. With A_{i,t} = A_i it equals gspo in value and gradient.
    cispo       CISPO (MiniMax-M1, 2025): -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * logp_t. The
                importance weight is clipped and detached, so every token keeps its gradient
                A_t * w_t * grad logp_t (PPO's clip zeroes the gradient of clipped tokens). The loss
                value is not a surrogate objective (it contains logp itself); its gradient is.

Aggregation (`loss_agg`): `token-mean` sums over tokens and divides by `normalizer` (default: the
local count of masked tokens; pass the global count when gradients are accumulated over
micro-batches / ranks); `seq-mean` averages each sequence over its own tokens, sums over sequences
and divides by `normalizer` (default: the local number of sequences with a masked token);
`seq-mean-token-sum-norm` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A
Critical Perspective") sums over all tokens and divides by the constant max_response_length x number
of sequences, so neither a sequence's length nor the batch's token count scales its tokens' gradient
(`normalizer` overrides the product; pass max_new_tokens x the global sequence count).

Rollout/training mismatch (the rollout engine's numerics differ from training's: another engine,
precision or kernel; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"), with rho_t = pi_old / pi_rollout from the training-side old log-probs:

    tis   truncated importance sampling: each token's loss is multiplied by sg[min(rho_t, C)]
    mis   masked importance sampling: sequences whose geometric-mean ratio
          exp(mean_t log rho_t) lies outside [1/C, C] are dropped (removed from the mask, hence from
          the default normaliser; a caller passing a global normaliser drops them before counting)

Whenever `rollout_logp` is given the metrics hold the mismatch KL(pi_rollout || pi_old) (k3 estimator,
sampled from the rollout) and min / mean / max of rho_t.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

__all__ = [
    "PolicyLossOutput", "policy_loss", "kl_penalty", "aggregate_loss", "rollout_correction_mask",
    "POLICY_LOSS_VARIANTS", "LOSS_AGGS", "ROLLOUT_CORRECTIONS",
]

POLICY_LOSS_VARIANTS = ("clip", "gspo", "gspo_token", "cispo")
LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")

# exp() of a log-ratio beyond +-20 overflows nothing in fp32 but produces astronomically large
# ratios that only appear with corrupted log-probs; the clamp keeps the loss finite (as verl does).
_LOG_RATIO_CLAMP = 20.0


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


def _seq_index(mask: torch.Tensor, seq_ids: Optional[torch.Tensor], why: str = "loss_agg='seq-mean'") -> torch.Tensor:
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
            f"{why} on a {mask.dim()}-D (packed) layout needs seq_ids; rows of a 2-D [B, T] "
            "layout are taken as the sequences"
        )
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)


def _segments(mask: torch.Tensor, seq_ids: Optional[torch.Tensor], why: str) -> tuple[torch.Tensor, int]:
    """(sequence index of every position, 0 where masked out; number of segments)."""
    idx = _seq_index(mask, seq_ids, why)
    idx = torch.where(mask, idx, torch.zeros_like(idx))
    n_seq = int(idx.max().item()) + 1 if idx.numel() else 1
    return idx, n_seq


def _seg_sum(values: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Per-segment sum of `values` over masked positions ([n_seq], differentiable)."""
    m = mask.to(values.dtype)
    return torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, idx.flatten(), (values * m).flatten())


def _seg_mean(values: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-segment mean over masked positions, [n_seq] bool: segment has a masked position)."""
    cnt = _seg_sum(torch.ones_like(values), mask, idx, n_seq)
    return _seg_sum(values, mask, idx, n_seq) / cnt.clamp_min(1.0), cnt > 0


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"],
    *,
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
    max_response_length: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (see the module docstring for the three modes)."""
    m = mask.to(per_token.dtype)

    def div(x: torch.Tensor, denom) -> torch.Tensor:
        return x / torch.clamp_min(torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device), 1.0)

    if loss_agg == "token-mean":
        return div((per_token * m).sum(), m.sum() if normalizer is None else normalizer)
    if loss_agg == "seq-mean":
        idx, n_seq = _segments(mask, seq_ids, "loss_agg='seq-mean'")
        seq_mean, present = _seg_mean(per_token, mask, idx, n_seq)
        return div(seq_mean[present].sum(), present.sum() if normalizer is None else normalizer)
    if loss_agg == "seq-mean-token-sum-norm":
        if normalizer is None:
            if max_response_length is None or max_response_length < 1:
                raise ValueError("loss_agg='seq-mean-token-sum-norm': needs max_response_length (the generation budget, "
                                 f"max_new_tokens) or an explicit normalizer, got max_response_length={max_response_length}")
            idx, n_seq = _segments(mask, seq_ids, "loss_agg='seq-mean-token-sum-norm'")
            present = _seg_sum(torch.ones_like(per_token), mask, idx, n_seq) > 0
            normalizer = present.sum() * max_response_length
        return div((per_token * m).sum(), normalizer)
    raise ValueError(f"loss_agg: must be one of {LOSS_AGGS}, got {loss_agg!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(torch.float32)
    return (x.detach().float() * m).sum() / m.sum().clamp_min(1.0)


def rollout_correction_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    seq_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """MIS: the mask with every sequence whose geometric-mean ratio exp(mean_t (old_logp - rollout_logp))
    lies outside [1/cap, cap] removed (a sequence of one token compares that token's ratio)."""
    if cap <= 1:
        raise ValueError(f"rollout_correction_cap: must be > 1, got {cap}")
    idx, n_seq = _segments(mask, seq_ids, "rollout_correction='mis'")
    d = (old_logp.detach() - rollout_logp.detach()).to(torch.float64)
    log_geo, _ = _seg_mean(d, mask, idx, n_seq)
    log_cap = torch.log(torch.tensor(float(cap), dtype=torch.float64))
    keep_seq = (log_geo >= -log_cap) & (log_geo <= log_cap)
    return mask & keep_seq[idx]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = "token-mean",
    variant: Literal["clip", "gspo", "gspo_token", "cispo"] = "clip",
    seq_ids: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
    max_response_length: Optional[int] = None,
    ref_logp: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
    behav_logp: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    rollout_logp: Optional[torch.Tensor] = None,
    rollout_correction: Literal["none", "tis", "mis"] = "none",
    rollout_correction_cap: Optional[float] = None,
) -> PolicyLossOutput:
    """Policy-gradient loss of `variant` (module docstring) with optional KL penalty, entropy bonus,
    rollout-mismatch correction and decoupled behaviour weighting.

    Clip ranges: `clip_ratio_low` / `clip_ratio_high` for every variant (for gspo / gspo_token they
    bound the *sequence* ratio: the GSPO paper uses 3e-4 / 4e-4; CISPO bounds the detached weight).
    `entropy_coef` > 0 subtracts entropy_coef x the aggregated `entropy` (which must then carry a
    gradient). With `behav_logp`, each token's term is multiplied by the detached importance weight
    w = exp(old_logp - behav_logp); tokens with w > behav_imp_weight_cap get weight 0 but stay in the
    normaliser (AReaL's decoupled PPO). `rollout_correction` ("tis" / "mis", cap C > 1) needs
    `rollout_logp`, and `old_logp` must then be the training-side recomputation.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: must be a bool tensor, got {mask.dtype}")
    if variant not in POLICY_LOSS_VARIANTS:
        raise ValueError(f"variant: must be one of {POLICY_LOSS_VARIANTS}, got {variant!r}")
    if clip_ratio_low < 0 or clip_ratio_low >= 1 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios: need 0 <= low < 1 and high >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef: must be >= 0, got {entropy_coef}")
    if advantages.dim() == logp.dim() - 1 and logp.dim() == 2:
        advantages = advantages[:, None]
    try:
        adv = torch.broadcast_to(advantages.detach().to(logp.dtype), logp.shape)
    except RuntimeError:
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} does not broadcast to logp {tuple(logp.shape)}") from None
    for name, t in (("ref_logp", ref_logp), ("behav_logp", behav_logp), ("rollout_logp", rollout_logp), ("entropy", entropy)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must equal logp's {tuple(logp.shape)}")

    metrics: dict[str, torch.Tensor] = {}
    old = old_logp.detach()

    # ---- rollout / training mismatch: metrics whenever both log-probs are given, then the correction
    token_w: Optional[torch.Tensor] = None
    if rollout_correction not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction: must be one of {ROLLOUT_CORRECTIONS}, got {rollout_correction!r}")
    if rollout_correction != "none":
        if rollout_logp is None:
            raise ValueError(f"rollout_logp: required by rollout_correction={rollout_correction!r}")
        if rollout_correction_cap is None or rollout_correction_cap <= 1:
            raise ValueError(f"rollout_correction_cap: must be > 1, got {rollout_correction_cap}")
        if behav_logp is not None:
            raise ValueError("behav_logp: the decoupled weighting exp(old - behav) already is the rollout ratio; "
                             "do not combine it with rollout_correction")
    if rollout_logp is not None:
        with torch.no_grad():
            d = (old - rollout_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log rho
            rho = torch.exp(d)
            metrics["mismatch_kl"] = _masked_mean(torch.exp(d) - d - 1.0, mask)  # k3 of KL(pi_rollout || pi_old)
            metrics["mismatch_ratio_mean"] = _masked_mean(rho, mask)
            if mask.any():
                metrics["mismatch_ratio_min"] = rho[mask].min().float()
                metrics["mismatch_ratio_max"] = rho[mask].max().float()
            if rollout_correction == "tis":
                token_w = rho.clamp_max(rollout_correction_cap).to(logp.dtype)
                metrics["tis_capped_frac"] = _masked_mean(rho > rollout_correction_cap, mask)
                metrics["tis_weight_mean"] = _masked_mean(token_w, mask)
            elif rollout_correction == "mis":
                kept = rollout_correction_mask(old, rollout_logp, mask, cap=rollout_correction_cap, seq_ids=seq_ids)
                metrics["mis_dropped_frac"] = _masked_mean(~kept, mask)  # share of tokens in dropped sequences
                mask = kept

    # ---- the policy-gradient term per token
    log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    lo, hi = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high
    if variant == "cispo":
        ratio = torch.exp(log_ratio)
        w = ratio.detach().clamp(lo, hi)
        pg = -adv * w * logp
        clipped_low, clipped_high = ratio.detach() < lo, ratio.detach() > hi
        clipped = clipped_low | clipped_high
    else:
        if variant == "clip":
            ratio = torch.exp(log_ratio)
        else:
            why = f"variant={variant!r}"
            idx, n_seq = _segments(mask, seq_ids, why)
            seq_log_ratio, _ = _seg_mean(log_ratio, mask, idx, n_seq)
            if variant == "gspo":
                seq_adv, _ = _seg_mean(adv, mask, idx, n_seq)
                dev = ((adv - seq_adv[idx]).abs() * mask).max() if mask.any() else adv.new_zeros(())
                if float(dev) > 1e-6 * (1.0 + float(seq_adv.abs().max())):
                    raise ValueError("advantages: variant 'gspo' takes one advantage per sequence; these vary within a "
                                     "sequence (use variant 'gspo_token' for per-token advantages)")
                ratio = torch.exp(seq_log_ratio)[idx]  # differentiable through every token of the sequence
            else:  # gspo_token: the value of s_i, the gradient of the token's own log-prob
                ratio = torch.exp(seq_log_ratio.detach())[idx] * torch.exp(logp - logp.detach())
        pg_unclipped = -adv * ratio
        pg_clipped = -adv * ratio.clamp(lo, hi)
        pg = torch.maximum(pg_unclipped, pg_clipped)
        clipped = pg_clipped.detach() > pg_unclipped.detach()
        clipped_low = (adv < 0) & (ratio.detach() < lo)
        clipped_high = (adv > 0) & (ratio.detach() > hi)

    if token_w is not None:
        pg = pg * token_w
    if behav_logp is not None:
        bw = torch.exp((old - behav_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).to(pg.dtype)
        if behav_imp_weight_cap is not None:
            capped = bw > behav_imp_weight_cap
            metrics["behav_capped_frac"] = _masked_mean(capped, mask)
            bw = torch.where(capped, torch.zeros_like(bw), bw)
        metrics["behav_imp_weight"] = _masked_mean(bw, mask)
        pg = pg * bw
    elif behav_imp_weight_cap is not None:
        raise ValueError("behav_imp_weight_cap: only meaningful with behav_logp (the decoupled loss)")

    agg = dict(seq_ids=seq_ids, normalizer=normalizer, max_response_length=max_response_length)
    pg_loss = aggregate_loss(pg, mask, loss_agg, **agg)
    loss = pg_loss
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask)
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate_loss(kl, mask, loss_agg, **agg)
    elif kl_coef > 0:
        raise ValueError("ref_logp: required when kl_coef > 0")
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy: required when entropy_coef > 0")
        loss = loss - entropy_coef * aggregate_loss(entropy, mask, loss_agg, **agg)

    with torch.no_grad():
        metrics["pg_loss"] = pg_loss.detach().float()
        metrics["clip_frac"] = _masked_mean(clipped, mask)
        metrics["clip_frac_low"] = _masked_mean(clipped_low, mask)
        metrics["clip_frac_high"] = _masked_mean(clipped_high, mask)
        metrics["ratio_mean"] = _masked_mean(ratio, mask)
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy, mask)
    return PolicyLossOutput(loss=loss, metrics=metrics, num_tokens=mask.sum())
