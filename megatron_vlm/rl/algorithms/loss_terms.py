"""The tensor pieces every RL loss is made of: per-sequence segments of a packed or padded layout, the three
loss aggregations, the KL estimators, MIS's sequence mask and masked means for metrics.

Why apart from the losses: the policy losses, and the value / preference losses that register later, all
reduce per-token terms the same way (`aggregate_loss`); the definitions and equations are in the module
docstring of `megatron_vlm.rl.losses`.

Why the segment count comes from the host: the per-segment sums need it as a size, and on CUDA reading it from
the device (`idx.max()`) is a stream sync per call (a micro-batch's loss, its MIS mask and its GSPO ratio each made
one, with the seq_ids check two more). The trainers move `seq_ids` with a host copy (`megatron_vlm.host_copies`),
whose maximum + 1 bounds the count: a segment past the last masked one only adds an empty entry, which every
consumer leaves out (`present`, or indexed by `idx` only).
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from megatron_vlm.host_copies import all_on_host, on_host

__all__ = ["LOG_RATIO_CLAMP", "LOSS_AGGS", "ROLLOUT_CORRECTIONS", "kl_penalty", "aggregate_loss", "rollout_correction_mask",
           "segments", "segment_count", "seg_mean", "masked_mean"]

LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")

# exp() of a log-ratio beyond +-20 overflows nothing in fp32 but produces astronomically large
# ratios that only appear with corrupted log-probs; the clamp keeps the loss finite (as verl does).
LOG_RATIO_CLAMP = 20.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref (unbiased, can be negative); k3 = exp(d) - d - 1 with
    d = log pi_ref - log pi (unbiased, always >= 0, lower variance; Schulman's "Approximating KL")."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator: must be 'k1' or 'k3', got {estimator!r}")


def _seq_index(mask: torch.Tensor, seq_ids: Optional[torch.Tensor], why: str = "loss_agg='seq-mean'") -> torch.Tensor:
    if seq_ids is not None:
        if seq_ids.shape != mask.shape:
            raise ValueError(f"seq_ids: shape {tuple(seq_ids.shape)} must equal the mask's {tuple(mask.shape)}")
        if seq_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seq_ids: must be an integer tensor, got {seq_ids.dtype}")
        if not _ids_non_negative_on_host(mask, seq_ids) and mask.any() and int(seq_ids[mask].min()) < 0:
            raise ValueError("seq_ids: masked tokens must have sequence ids >= 0")
        return seq_ids.long()
    if mask.dim() != 2:
        raise ValueError(
            f"{why} on a {mask.dim()}-D (packed) layout needs seq_ids; rows of a 2-D [B, T] "
            "layout are taken as the sequences"
        )
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)


def _ids_non_negative_on_host(mask: torch.Tensor, seq_ids: torch.Tensor) -> bool:
    """Whether the host copies show every masked position's id >= 0 (False: not known there; the device decides)."""
    ids = on_host(seq_ids)
    if ids.device.type == "cpu" and not bool((ids < 0).any()):  # every id, masked or not: enough
        return True
    host = all_on_host(mask, seq_ids)  # a negative id: only the masked ones count
    if host is None:
        return False
    m, host_ids = host
    assert m is not None and host_ids is not None
    return not bool((host_ids[m] < 0).any())


def segment_count(mask: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> Optional[int]:
    """An upper bound of the segments' count known on the host (module docstring), else None: the rows of a
    padded [B, T] layout, one more than the largest id of `seq_ids`' host copy."""
    if seq_ids is None:
        return max(mask.shape[0], 1) if mask.dim() == 2 else None
    ids = on_host(seq_ids)
    if ids.device.type != "cpu":
        return None
    return int(ids.max()) + 1 if ids.numel() and int(ids.max()) >= 0 else 1


def segments(mask: torch.Tensor, seq_ids: Optional[torch.Tensor], why: str) -> tuple[torch.Tensor, int]:
    """(sequence index of every position, 0 where masked out; number of segments: at least one more than the
    largest masked index; segments without a masked position come out empty, see `seg_mean`'s `present`)."""
    idx = _seq_index(mask, seq_ids, why)
    idx = torch.where(mask, idx, torch.zeros_like(idx))
    n_seq = segment_count(mask, seq_ids)
    if n_seq is None:  # a device tensor without a host copy: read the count from it
        n_seq = int(idx.max().item()) + 1 if idx.numel() else 1
    return idx, n_seq


def _seg_sum(values: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Per-segment sum of `values` over masked positions ([n_seq], differentiable)."""
    m = mask.to(values.dtype)
    return torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, idx.flatten(), (values * m).flatten())


def seg_mean(values: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        if torch.is_tensor(denom):
            d = denom.to(dtype=per_token.dtype, device=per_token.device)
        else:  # a number: filled in on the device (a tensor made from it there would be a blocking upload)
            d = torch.full((), denom, dtype=per_token.dtype, device=per_token.device)
        return x / torch.clamp_min(d, 1.0)

    if loss_agg == "token-mean":
        return div((per_token * m).sum(), m.sum() if normalizer is None else normalizer)
    if loss_agg == "seq-mean":
        idx, n_seq = segments(mask, seq_ids, "loss_agg='seq-mean'")
        seq_mean, present = seg_mean(per_token, mask, idx, n_seq)
        # the present segments' means (a bool-mask index would read their count from the device)
        return div(torch.where(present, seq_mean, torch.zeros_like(seq_mean)).sum(),
                   present.sum() if normalizer is None else normalizer)
    if loss_agg == "seq-mean-token-sum-norm":
        if normalizer is None:
            if max_response_length is None or max_response_length < 1:
                raise ValueError("loss_agg='seq-mean-token-sum-norm': needs max_response_length (the generation budget, "
                                 f"max_new_tokens) or an explicit normalizer, got max_response_length={max_response_length}")
            idx, n_seq = segments(mask, seq_ids, "loss_agg='seq-mean-token-sum-norm'")
            present = _seg_sum(torch.ones_like(per_token), mask, idx, n_seq) > 0
            normalizer = present.sum() * max_response_length
        return div((per_token * m).sum(), normalizer)
    raise ValueError(f"loss_agg: must be one of {LOSS_AGGS}, got {loss_agg!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
    idx, n_seq = segments(mask, seq_ids, "rollout_correction='mis'")
    d = (old_logp.detach() - rollout_logp.detach()).to(torch.float64)
    log_geo, _ = seg_mean(d, mask, idx, n_seq)
    log_cap = torch.log(torch.tensor(float(cap), dtype=torch.float64))
    keep_seq = (log_geo >= -log_cap) & (log_geo <= log_cap)
    return mask & keep_seq[idx]
