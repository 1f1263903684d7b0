"""`attention` on `torch.nn.functional.scaled_dot_product_attention` (SDPA), for every device.

Why: the torch reference materialises fp32 `[H, S, S]` scores per sample and loops over the packed
samples in Python, so a 16k-token sequence needs gigabytes and a pack of 40 short samples costs 40
small matmuls per layer. SDPA picks torch's fused kernels (the flash kernel on CPU, flash /
memory-efficient on CUDA), which stream over keys and never hold the scores.

Packed varlen `[T, H, D]` + cu_seqlens runs in one SDPA call without a Python loop over samples, on
the cheaper of two layouts (the fused kernels compute every score a mask lets through or not):
- a right-padded batch `[n, max_len, H, D]` gathered by one index_select (work n x max_q x max_k:
  many short samples, the usual SFT / GRPO pack), with a per-sample causal / window / length mask;
- the whole pack with a block-diagonal boolean mask built by tensor ops from the segment ids (work
  Tq x Tk: one long sample among short ones). When that `[Tq, Tk]` mask exceeds
  `MAX_MASK_ELEMENTS`, the queries are cut into tiles and each tile attends only to the keys of
  the samples it touches, so memory stays O(tile x span) for 16-20k-token sequences.
Query i of sample s sees key j iff j belongs to s and the causal / window rule holds between their
in-sample positions (bottom-right alignment, as in the reference). A single causal / full sample
without window needs no mask at all (SDPA's `is_causal`).

Rows that see no key (Sq > Sk with causal, fully padded rows) output zeros, as in the reference:
such a row is given one dummy visible key (so that no kernel produces NaN, whose gradient would
leak into the other rows) and its output is then zeroed (its gradient is zero too).

GQA: on CPU SDPA's `enable_gqa` reads the shared kv heads directly; elsewhere the kv heads are
repeated when a mask is used (the CUDA memory-efficient kernel, the one taking a mask, does not
accept `enable_gqa` in every torch version, and the math fallback would materialise the scores).
"""
import bisect
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference.attention import prepare_attention_args

# Above this many mask entries (bools; 256 MiB) the packed path tiles the queries.
MAX_MASK_ELEMENTS = 1 << 28

# Up to this many mask entries (4 MiB) `_sdpa` handles rows without a visible key without first reading whether
# there are any; above it, a copy of the mask costs more than the read.
_ALWAYS_FIX_ELEMENTS = 1 << 22


def _sdpa(q, k, v, mask, scale, is_causal=False):
    """q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D], mask broadcastable to [B, 1, Sq, Sk] or None."""
    groups = q.shape[1] // k.shape[1]
    kwargs = {}
    if groups > 1:
        if q.device.type == "cpu" or mask is None:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    empty_rows = None
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)
        # a small mask (a rollout prefill's padding) gets the dummy key and the zeroing whether a row needs them or not
        # (nothing changes where none does): the check would read the device, a sync per layer on CUDA
        if mask.numel() <= _ALWAYS_FIX_ELEMENTS or not bool(has_key.all()):
            empty_rows = ~has_key
            first_key = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
            first_key[0] = True
            mask = mask | (empty_rows & first_key)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **kwargs)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out


def _rule(pos_q, pos_k, causal: bool, left: int, right: int) -> Optional[torch.Tensor]:
    """[Sq, Sk] bools of the causal / window rule between aligned positions (None: no constraint).
    One comparison of [Sq, Sk] per bound (the mask is rebuilt per layer; keep it cheap)."""
    del causal  # folded into `right` (0 when causal) by normalize_window
    mask = None
    if right >= 0:
        mask = pos_k[None, :] <= (pos_q + right)[:, None]
    if left >= 0:
        lo = pos_k[None, :] >= (pos_q - left)[:, None]
        mask = lo if mask is None else mask & lo
    return mask


def _batched(q, k, v, causal, left, right, scale, key_padding_mask):
    sq, sk = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    plain = left < 0 and (right < 0 or (causal and right == 0))
    if key_padding_mask is None and plain and (not causal or sq == sk):
        return _sdpa(qt, kt, vt, None, scale, is_causal=causal).transpose(1, 2)
    pos_q = torch.arange(sq, device=q.device) + (sk - sq)
    mask = _rule(pos_q, torch.arange(sk, device=q.device), causal, left, right)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device) if mask is None else mask
    mask = mask[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    return _sdpa(qt, kt, vt, mask, scale).transpose(1, 2)


def _segments(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(segment id, position in its segment, segment length) per token, from cumulative lengths."""
    cu = cu.to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device, dtype=torch.int32), lengths,
                                  output_size=total)
    pos = torch.arange(total, device=cu.device, dtype=torch.int32) - cu[seg]
    return seg, pos, lengths


def _padded(q, k, v, cu_q, cu_k, max_q, max_k, left, right, scale):
    """Packed samples gathered into a right-padded batch [n, max_len, H, D] (one index_select, no
    loop), one batched SDPA call with a per-sample mask, and the valid rows gathered back in pack
    order. Attention work is n x max_q x max_k instead of the pack's Tq x Tk under a block mask (which
    the fused kernels compute in full): what makes many short samples per pack cheap."""
    dev = q.device
    cu_q, cu_k = cu_q.to(dev, torch.long), cu_k.to(dev, torch.long)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    ar_q, ar_k = torch.arange(max_q, device=dev), torch.arange(max_k, device=dev)
    valid_q = ar_q[None, :] < len_q[:, None]  # [n, max_q]
    valid_k = ar_k[None, :] < len_k[:, None]
    idx_q = (cu_q[:-1, None] + ar_q[None, :]).clamp_(max=max(q.shape[0] - 1, 0))
    idx_k = (cu_k[:-1, None] + ar_k[None, :]).clamp_(max=max(k.shape[0] - 1, 0))
    n = len_q.numel()
    qb = q.index_select(0, idx_q.reshape(-1)).view(n, max_q, *q.shape[1:]).transpose(1, 2)
    kb = k.index_select(0, idx_k.reshape(-1)).view(n, max_k, *k.shape[1:]).transpose(1, 2)
    vb = v.index_select(0, idx_k.reshape(-1)).view(n, max_k, *v.shape[1:]).transpose(1, 2)
    mask = valid_k[:, None, :]  # [n, 1 (queries broadcast), max_k]
    aligned = ar_q[None, :] + (len_k - len_q)[:, None]  # bottom-right alignment per sample
    if right >= 0:
        mask = mask & (ar_k[None, None, :] <= (aligned + right)[:, :, None])
    if left >= 0:
        mask = mask & (ar_k[None, None, :] >= (aligned - left)[:, :, None])
    mask = mask.expand(n, max_q, max_k) & valid_q[:, :, None]
    out = _sdpa(qb, kb, vb, mask[:, None], scale)  # [n, H, max_q, D]
    return out.transpose(1, 2)[valid_q]


def _packed(q, k, v, cu_q, cu_k, causal, left, right, scale):
    bq, bk = cu_q.tolist(), cu_k.tolist()  # one host sync, as the reference; validates the ranges
    tq, tk = q.shape[0], k.shape[0]
    if bq[0] != 0 or bq[-1] != tq or bk[0] != 0 or bk[-1] != tk or any(
        b < a for a, b in zip(bq, bq[1:])
    ) or any(b < a for a, b in zip(bk, bk[1:])):
        raise ValueError(
            f"attention: cu_seqlens must start at 0, not decrease and end at the token counts (q {tq}, k {tk}), "
            f"got q {bq[:4]}..{bq[-1]}, k {bk[:4]}..{bk[-1]}"
        )
    if tq == 0:
        return torch.zeros_like(q)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T, D] views
    plain = left < 0 and (right < 0 or (causal and right == 0))
    if len(bq) == 2 and plain and tq == tk:  # one sample: no mask needed
        return _sdpa(qt, kt, vt, None, scale, is_causal=causal)[0].transpose(0, 1)
    seg_q, pos_q, len_q = _segments(cu_q.to(q.device), tq)
    seg_k, pos_k, len_k = _segments(cu_k.to(q.device), tk)
    aligned_q = pos_q + (len_k - len_q)[seg_q]  # bottom-right alignment within each sample

    def tile_mask(q0, q1, k0, k1):
        mask = seg_q[q0:q1, None] == seg_k[None, k0:k1]
        rule = _rule(aligned_q[q0:q1], pos_k[k0:k1], causal, left, right)
        return mask if rule is None else mask & rule

    n = len(bq) - 1
    max_q = max(b - a for a, b in zip(bq, bq[1:]))
    max_k = max(b - a for a, b in zip(bk, bk[1:]))
    if n * max_q * max_k <= min(tq * tk, MAX_MASK_ELEMENTS):
        return _padded(q, k, v, cu_q, cu_k, max_q, max_k, left, right, scale)
    if tq * tk <= MAX_MASK_ELEMENTS:
        return _sdpa(qt, kt, vt, tile_mask(0, tq, 0, tk), scale)[0].transpose(0, 1)
    # Long packs: query tiles, each against the keys of the samples it touches.
    tile = max(1, MAX_MASK_ELEMENTS // tk)
    outs = []
    for q0 in range(0, tq, tile):
        q1 = min(q0 + tile, tq)
        s_first = bisect.bisect_right(bq, q0) - 1  # the sample holding query q0 (skips empty ones)
        s_last = bisect.bisect_right(bq, q1 - 1) - 1
        k0, k1 = bk[s_first], bk[s_last + 1]
        if k1 == k0:
            outs.append(q.new_zeros(1, q.shape[1], q1 - q0, q.shape[2]))
            continue
        outs.append(_sdpa(qt[:, :, q0:q1], kt[:, :, k0:k1], vt[:, :, k0:k1], tile_mask(q0, q1, k0, k1), scale))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    window: Optional[tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Public-signature attention on SDPA (contract: kernels/reference/attention.py)."""
    del max_seqlen_q, max_seqlen_k  # SDPA needs no hints
    cu_seqlens_q, cu_seqlens_k, left, right, scale = prepare_attention_args(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
    if q.dim() == 4:
        return _batched(q, k, v, causal, left, right, scale, key_padding_mask)
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, left, right, scale)
