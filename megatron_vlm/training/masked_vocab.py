"""Token log-probs (and entropy) of the distribution with a few vocabulary ids masked, from any fused kernel's.

Why: the rollout engines never sample a VLM's vision tokens (image / video placeholders, vision start / end):
the built-in engine suppresses them, vLLM gets a -100 logit bias on them. The tokens are then drawn from
q = softmax(z / T) restricted to the other ids and renormalised, and every RL log-prob (the engines'
behaviour log-probs, the old-log-prob recompute, the update's log-probs and entropy, the reference model's)
must be of that same q, or the importance ratios and the KL carry a term log(1 - p(vision)) that nothing in
training pulls down (the masked ids are never sampled, so never pushed down either) and that grows as the
policy drifts.

Exact correction from the full-softmax results, for any kernel that never materialises the [N, V] logits:
with S the masked ids, p_s their full-softmax probabilities and P = sum_s p_s,

    log q(y)  = log p(y) - log(1 - P)                                    (y not in S)
    H(q)      = (H(p) + sum_s p_s log p_s) / (1 - P) + log(1 - P)

and log p_s = z_s / T - lse with lse = z_y / T - log p(y): only the [N, |S|] logits of the masked rows of
the LM head (one small matmul) and the label's own logit are needed. The result is differentiable through
the kernel's log-prob / entropy and through the small matmuls, so gradients are those of a plain masked
log_softmax. The correction divides by 1 - P: rows where the masked ids hold more than half of the mass (where
it would amplify the rounding of log p more than twofold, and P may round to 1) are recomputed exactly from their
own full logits instead. Rows whose label is ignored (-100) are left as the kernel gave them; a label that is
itself a masked id (never sampled, so never trained on in RL) keeps its full-softmax log-prob.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["masked_token_logprobs"]

IGNORE_INDEX = -100
# log p_s of rows that need no correction: exp() of it is exactly 0 in fp32 / fp64 and 0 * it is 0 (no NaN)
_NEG = -1.0e4
_ROWS = 4096
# rows whose kept mass 1 - P is below this are computed exactly (their [rows, V] logits): the correction's
# rounding error is log p's divided by 1 - P (its gradient's likewise), so at most twice the kernel's own
_MIN_KEPT = 0.5
_EXACT_ROWS = 256


def masked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, logp: torch.Tensor,
                          ent: Optional[torch.Tensor], masked_ids: Sequence[int], *, temperature: float = 1.0):
    """(log q(labels) [N], H(q) [N] or None) from the full-softmax `logp` / `ent` that a fused kernel computed
    for softmax(hidden @ weight^T / temperature), q being that distribution with `masked_ids` removed
    (module docstring). `weight` [V, H] is the dense LM head; `masked_ids` empty returns the inputs."""
    ids = sorted({int(i) for i in masked_ids})
    if not ids:
        return logp, ent
    vocab = weight.shape[0]
    if ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"masked_token_logprobs: masked ids {ids} outside the vocabulary [0, {vocab})")
    sel = torch.tensor(ids, dtype=torch.long, device=weight.device)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0).long()
    correct = valid & ~torch.isin(safe, sel)
    t = float(temperature)
    ct = torch.promote_types(hidden.dtype, torch.float32)  # the kernels' logit dtype (fp32), fp64 kept for tests
    # the label's logit, row by row (chunks bound the gathered [rows, H] weight copy), and the masked ids' logits
    z_y = torch.cat([(hidden[s:s + _ROWS].to(ct) * weight.index_select(0, safe[s:s + _ROWS]).to(ct)).sum(-1)
                     for s in range(0, hidden.shape[0], _ROWS)] or [hidden.new_zeros(0, dtype=ct)]) / t
    z_s = torch.matmul(hidden, weight.index_select(0, sel).t()).to(ct) / t               # [N, |S|]
    lse = z_y - logp.to(ct)
    log_ps = (z_s - lse[:, None]).masked_fill(~correct[:, None], _NEG)
    p_s = log_ps.exp()
    # rows where the masked ids hold most of the mass: dividing by 1 - P would amplify the rounding of log p (and
    # P may round to 1): those rows are recomputed exactly from their full logits instead (rare: a few rows)
    exact = correct & (p_s.detach().sum(-1) > 1.0 - _MIN_KEPT)
    mass = torch.where(exact, 0.0, p_s.sum(-1))  # where, not a product: no 0 * inf in the backward
    log_keep = torch.log1p(-mass)                                                         # log(1 - P), 0 where no correction
    out_logp = logp.to(ct) - log_keep
    out_ent = None
    if ent is not None:
        full_ent = ent.to(ct)
        plog = torch.where(exact[:, None], 0.0, p_s * log_ps)
        out_ent = torch.where(correct, (full_ent + plog.sum(-1)) / (1.0 - mass) + log_keep, full_ent)
    if bool(exact.any()):
        rows = exact.nonzero().squeeze(-1)
        lq, hq = _exact_rows(hidden.index_select(0, rows), weight, safe.index_select(0, rows), sel, t, ct)
        out_logp = out_logp.index_put((rows,), lq)
        if out_ent is not None:
            out_ent = out_ent.index_put((rows,), hq)
    return out_logp, out_ent


def _exact_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, sel: torch.Tensor, t: float,
                ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """log q(label) and H(q) of a few rows from their full logits (the masked ids filled with a finite -1e30:
    exp() is 0 there and 0 * fill is 0, no NaN), in chunks of rows."""
    lqs, hqs = [], []
    for s in range(0, hidden.shape[0], _EXACT_ROWS):
        z = (torch.matmul(hidden[s:s + _EXACT_ROWS], weight.t()).to(ct) / t).index_fill(-1, sel, -1.0e30)
        logq = torch.log_softmax(z, dim=-1)
        lqs.append(logq.gather(-1, labels[s:s + _EXACT_ROWS, None]).squeeze(-1))
        hqs.append(-(logq.exp() * logq).sum(-1))
    return torch.cat(lqs), torch.cat(hqs)
