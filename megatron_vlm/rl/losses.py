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

Implementation: each variant is one function registered by name (rl/algorithms/policy_losses.py); the
settings are one frozen `PolicyLossSpec`, validated when built. The GRPO update builds it once per run;
`policy_loss` (this module's public call, with its keyword arguments) builds it per call.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from megatron_vlm.rl.algorithms.loss_terms import (
    LOSS_AGGS,
    ROLLOUT_CORRECTIONS,
    aggregate_loss,
    kl_penalty,
    rollout_correction_mask,
)
from megatron_vlm.rl.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossOutput,
    PolicyLossSpec,
    compute_policy_loss,
)

__all__ = [
    "PolicyLossOutput", "PolicyLossSpec", "policy_loss", "kl_penalty", "aggregate_loss", "rollout_correction_mask",
    "POLICY_LOSS_VARIANTS", "LOSS_AGGS", "ROLLOUT_CORRECTIONS",
]

POLICY_LOSS_VARIANTS = tuple(POLICY_LOSSES.names())
"""The registered variants (`[rl] policy_loss`)."""


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
    spec = PolicyLossSpec(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, loss_agg=loss_agg,
                          variant=variant, max_response_length=max_response_length, kl_coef=kl_coef,
                          kl_estimator=kl_estimator, behav_imp_weight_cap=behav_imp_weight_cap, entropy_coef=entropy_coef,
                          rollout_correction=rollout_correction, rollout_correction_cap=rollout_correction_cap)
    return compute_policy_loss(spec, logp, old_logp, advantages, mask, seq_ids=seq_ids, normalizer=normalizer,
                               ref_logp=ref_logp, behav_logp=behav_logp, entropy=entropy, rollout_logp=rollout_logp)
