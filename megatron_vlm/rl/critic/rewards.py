"""Per-token rewards of PPO-RLHF (Stiennon et al. 2020; Ouyang et al. 2022): the sequence reward on the last
response token and, with `loss.kl_coef` > 0, the KL penalty on every token,

    r_t = -kl_coef * KL_t + [t = last] * score,    KL_t = kl_estimator(log pi_old(y_t), log pi_ref(y_t))

(`loss.kl_estimator`: k1 = log pi_old - log pi_ref is PPO-RLHF's; k3 is non-negative). With advantage = "gae"
the penalty lives here, in the reward the critic learns to predict, and not in the policy loss.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_vlm.rl.algorithms.loss_terms import kl_penalty

__all__ = ["token_rewards"]


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
