"""Per-token rewards of PPO-RLHF (Stiennon et al. 2020; Ouyang et al. 2022): the sequence reward on the last
response token and, with `loss.kl_coef` > 0, the KL penalty on every token,

    r_t = -kl_coef * KL_t + [t = last] * score,    KL_t = kl_estimator(log pi_old(y_t), log pi_ref(y_t))

(`loss.kl_estimator`: k1 = log pi_old - log pi_ref is PPO-RLHF's; k3 is non-negative). With advantage = "gae"
the penalty lives here, in the reward the critic learns to predict, and not in the policy loss.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_vlm.rl.algorithms.loss_terms import kl_penalty

__all__ = ["step_token_rewards", "token_rewards"]


def token_rewards(score: float, length: int, *, old_logp: Optional[torch.Tensor] = None,
                  ref_logp: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                  kl_estimator: str = "k1") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([length] rewards, [length] KL_t or None without a reference) of one completion (float32)."""
    if length < 1:
        raise ValueError(f"length: a completion has >= 1 token, got {length}")
    r = torch.zeros(length, dtype=torch.float32)
    kl = None
    if ref_logp is not None:
        if old_logp is None or old_logp.numel() != length or ref_logp.numel() != length:
            raise ValueError(f"old_logp / ref_logp: need {length} entries each")
        kl = kl_penalty(old_logp.detach().float(), ref_logp.detach().float(), kl_estimator)  # type: ignore[arg-type]
        r = r - kl_coef * kl
    elif kl_coef > 0:
        raise ValueError("ref_logp: required when kl_coef > 0")
    r[-1] += float(score)
    return r, kl


def step_token_rewards(scores: Sequence[float], lengths: Sequence[int], *,
                       old_logp: Sequence[Optional[torch.Tensor]], ref_logp: Sequence[Optional[torch.Tensor]],
                       kl_coef: float = 0.0, kl_estimator: str = "k1") -> tuple[torch.Tensor, float]:
    """(float32 [sum(lengths)] rewards of a step's completions, concatenated; their summed KL_t, 0 without a
    reference): `token_rewards` of each, with one KL over all the step's tokens when every completion has a
    reference, instead of a few tensor ops and a host read per completion.

    The rewards equal the concatenated `token_rewards` bit for bit (element-wise ops, the score added in float32 as
    there); the KL sum is taken in float64 over all tokens (per completion it was float32 sums, added)."""
    n = len(lengths)
    if len(scores) != n or len(old_logp) != n or len(ref_logp) != n:
        raise ValueError(f"scores, old_logp, ref_logp: need {n} entries each (one per completion)")
    if n == 0:
        return torch.zeros(0, dtype=torch.float32), 0.0
    if any(length < 1 for length in lengths):
        raise ValueError(f"lengths: a completion has >= 1 token, got {min(lengths)}")
    with_ref = [r is not None for r in ref_logp]
    if any(with_ref) and not all(with_ref):  # some completions without a reference (kl_coef = 0): one by one
        parts = [token_rewards(sc, length, old_logp=o, ref_logp=r, kl_coef=kl_coef, kl_estimator=kl_estimator)
                 for sc, length, o, r in zip(scores, lengths, old_logp, ref_logp)]
        kl_sum = sum(float(k.double().sum()) for _, k in parts if k is not None)
        return torch.cat([r for r, _ in parts]), kl_sum
    total = sum(lengths)
    r = torch.zeros(total, dtype=torch.float32)
    kl_sum = 0.0
    if with_ref[0]:
        for o, ref, length in zip(old_logp, ref_logp, lengths):
            if o is None or o.numel() != length or ref.numel() != length:  # type: ignore[union-attr]
                raise ValueError(f"old_logp / ref_logp: need {length} entries each")
        old = torch.cat([o.detach().reshape(-1) for o in old_logp]).float()  # type: ignore[union-attr]
        refs = torch.cat([x.detach().reshape(-1) for x in ref_logp]).float()  # type: ignore[union-attr]
        kl = kl_penalty(old, refs, kl_estimator)  # type: ignore[arg-type]
        r = r - kl_coef * kl
        kl_sum = float(kl.double().sum())
    elif kl_coef > 0:
        raise ValueError("ref_logp: required when kl_coef > 0")
    last = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0) - 1
    r[last] += torch.tensor([float(sc) for sc in scores], dtype=torch.float32)
    return r, kl_sum
