"""Reference scaled-dot-product attention: packed varlen or batched, GQA, causal, local windows.

Conventions (shared by every backend; they follow flash-attn so that models ported from it and
from transformers' flash path behave the same):

* Layouts: packed q `[T, Hq, D]`, k / v `[Tk, Hkv, D]` with `cu_seqlens_q` / `cu_seqlens_k` (int32,
  cumulative lengths starting at 0, one more entry than sequences); or batched q `[B, Sq, Hq, D]`,
  k / v `[B, Sk, Hkv, D]`. The output has q's layout and dtype.
* GQA / MQA: Hkv divides Hq; query head h reads kv head h // (Hq // Hkv) (transformers' repeat_kv).
* Alignment: query i of a sequence sits at key position i + Sk - Sq (bottom-right, as in decoding
  with a KV cache). `causal` lets it see keys j <= i + Sk - Sq.
* `window=(left, right)`: query i sees keys in [i + Sk - Sq - left, i + Sk - Sq + right]; -1 leaves
  that side unbounded. Combined with `causal`, the right side is additionally capped at 0.
* `key_padding_mask` (batched layout only): `[B, Sk]` bool, True = keep (attention_mask semantics of
  transformers), for left- or right-padded batches.
* A query that sees no key at all (e.g. Sq > Sk with causal, or a fully padded row) outputs zeros.
* `softmax_scale` defaults to D ** -0.5.

Numerics: with `upcast=True` (the default, what the `torch` backend runs) everything is computed in
fp32. `upcast=False` computes in the input dtype the naive way (scores, softmax and P @ V rounded
to it): that is the yardstick of the low-precision tests, not a backend.
"""
from typing import NamedTuple, Optional

import torch

_Window = Optional[tuple[int, int]]


def normalize_window(window: _Window, causal: bool) -> tuple[int, int]:
    """Return (left, right) with -1 = unbounded, right capped at 0 when causal."""
    if window is None:
        left, right = -1, -1
    else:
        if len(window) != 2 or any((not isinstance(w, int)) or w < -1 for w in window):
            raise ValueError(f"attention: window must be a pair of ints >= -1 (left, right), got {window!r}")
        left, right = int(window[0]), int(window[1])
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Validate shapes / dtypes and return (cu_seqlens_q, cu_seqlens_k) with cu_seqlens_k defaulted to q's."""
    packed = q.dim() == 3
    if q.dim() not in (3, 4):
        raise ValueError(f"attention: q must be [T, H, D] (packed) or [B, S, H, D], got shape {tuple(q.shape)}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"attention: q, k, v must have the same rank, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: head dim of q ({q.shape[-1]}) != head dim of k ({k.shape[-1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"attention: kv heads ({hkv}) must divide query heads ({hq})")
    if packed:
        if key_padding_mask is not None:
            raise ValueError("attention: key_padding_mask is for the batched [B, S, H, D] layout; packed inputs use cu_seqlens")
        if cu_seqlens_q is None:
            raise ValueError("attention: packed q [T, H, D] needs cu_seqlens_q")
        if cu_seqlens_k is None:
            if k.shape[0] != q.shape[0]:
                raise ValueError(
                    f"attention: cu_seqlens_k is required when q has {q.shape[0]} tokens and k has {k.shape[0]}"
                )
            cu_seqlens_k = cu_seqlens_q
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
                raise ValueError(f"attention: {name} must be a 1-D int32 tensor with >= 2 entries, got {cu.dtype} {tuple(cu.shape)}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"attention: cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences, cu_seqlens_k {cu_seqlens_k.numel() - 1}"
            )
    else:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("attention: cu_seqlens_* are for the packed [T, H, D] layout, q is batched [B, S, H, D]")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"attention: batch of q ({q.shape[0]}) != batch of k ({k.shape[0]})")
        if key_padding_mask is not None and (
            key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[1])
        ):
            raise ValueError(
                f"attention: key_padding_mask must be bool [B, Sk] = {(k.shape[0], k.shape[1])}, "
                f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
    return cu_seqlens_q, cu_seqlens_k


def check_cu_seqlens_lists(bq: list, bk: list, total_q: int, total_k: int) -> None:
    """ValueError unless the host copies of cu_seqlens start at 0, never decrease and end at the token counts
    (for backends that read them on the host anyway and hand them to a device op that does not check)."""
    if (bq[0] != 0 or bk[0] != 0 or bq[-1] != total_q or bk[-1] != total_k
            or any(b < a for a, b in zip(bq, bq[1:])) or any(b < a for a, b in zip(bk, bk[1:]))):
        raise ValueError(
            f"attention: cu_seqlens must start at 0, not decrease and end at the token counts (q {total_q}, k {total_k}), "
            f"got q {bq[:4]}..{bq[-1]}, k {bk[:4]}..{bk[-1]}"
        )


def packed_max_seqlens(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: Optional[int], max_k: Optional[int],
    *, check_hints: bool,
) -> tuple[int, int]:
    """The longest query and key sample of a pack: the hints when both are given (and `check_hints` is False: no
    host sync, the caller trusts them as flash-attn does), else read from cu_seqlens in one host sync that also
    validates them (start at 0, never decrease, end at the token counts) and any hint given (a hint shorter than
    the longest sample would leave query rows unwritten by a kernel that sizes its grid from it). Why: a kernel
    indexing by bad cu_seqlens reads and writes outside its tensors (garbage, or a crash), where a clear
    ValueError is what the other backends give."""
    if max_q is not None and max_k is not None and not check_hints:
        return int(max_q), int(max_k)
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    stats = torch.stack([lens_q.min(), lens_q.max(), cu_q[0], cu_q[-1], lens_k.min(), lens_k.max(), cu_k[0], cu_k[-1]])
    min_q, long_q, first_q, last_q, min_k, long_k, first_k, last_k = stats.tolist()
    if min(min_q, min_k) < 0 or first_q != 0 or first_k != 0 or last_q != total_q or last_k != total_k:
        raise ValueError(
            f"attention: cu_seqlens must start at 0, not decrease and end at the token counts (q {total_q}, k {total_k}), "
            f"got q {cu_q.tolist()[:4]}..{last_q}, k {cu_k.tolist()[:4]}..{last_k}"
        )
    for name, hint, longest in (("max_seqlen_q", max_q, long_q), ("max_seqlen_k", max_k, long_k)):
        if hint is not None and int(hint) < longest:
            raise ValueError(f"attention: {name}={hint} is shorter than the longest sample in cu_seqlens ({longest})")
    return (long_q if max_q is None else int(max_q)), (long_k if max_k is None else int(max_k))


def visible_mask(sq: int, sk: int, causal: bool, left: int, right: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] bool, True where query i may attend key j (bottom-right aligned)."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


class AttentionArgs(NamedTuple):
    """The normalised arguments every backend works from."""

    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]  # defaulted to cu_seqlens_q for packed self-attention
    left: int  # -1 = unbounded
    right: int  # -1 = unbounded; <= 0 when causal
    scale: float


def prepare_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    window: _Window,
    softmax_scale: Optional[float],
    key_padding_mask: Optional[torch.Tensor],
) -> AttentionArgs:
    """Validate the public `attention` arguments (`check_attention_inputs`), resolve the window
    (`normalize_window`) and the scale (default D ** -0.5): the part every backend shares."""
    cu_seqlens_q, cu_seqlens_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, key_padding_mask)
    left, right = normalize_window(window, causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return AttentionArgs(cu_seqlens_q, cu_seqlens_k, left, right, scale)


def _attend(q, k, v, mask, scale, upcast):
    """q [B, H, Sq, D], k / v [B, H, Sk, D], mask broadcastable to [B, H, Sq, Sk] (True = visible)."""
    dtype = q.dtype
    if upcast and dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()  # fp64 stays fp64 (the tests' ground truth)
    scores = torch.matmul(q * scale if not upcast else q, k.transpose(-1, -2))
    if upcast:
        scores = scores * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores if scores.dtype == torch.float64 else scores.float(), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows without any visible key -> zeros
    out = torch.matmul(probs.to(v.dtype), v)
    return out.to(dtype)


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
    window: _Window = None,
    softmax_scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    upcast: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per head; see the module docstring for the conventions."""
    del max_seqlen_q, max_seqlen_k  # hints for the kernels; the reference reads cu_seqlens directly
    cu_seqlens_q, cu_seqlens_k, left, right, scale = prepare_attention_args(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
    groups = q.shape[-2] // k.shape[-2]
    k = k.repeat_interleave(groups, dim=-2)
    v = v.repeat_interleave(groups, dim=-2)
    if q.dim() == 4:
        mask = visible_mask(q.shape[1], k.shape[1], causal, left, right, q.device)[None, None]
        if key_padding_mask is not None:
            mask = mask & key_padding_mask[:, None, None, :]
        out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, upcast)
        return out.transpose(1, 2)
    out = torch.zeros_like(q)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pieces = []
    for s in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[s], bq[s + 1], bk[s], bk[s + 1]
        if q1 < q0 or k1 < k0 or q1 > q.shape[0] or k1 > k.shape[0]:
            raise ValueError(f"attention: cu_seqlens entry {s} gives q[{q0}:{q1}] / k[{k0}:{k1}], out of range or decreasing")
        if q1 == q0:
            continue
        mask = visible_mask(q1 - q0, k1 - k0, causal, left, right, q.device)[None]
        o = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), mask, scale, upcast)
        pieces.append((q0, q1, o.transpose(0, 1)))
    if bq[0] != 0 or bq[-1] != q.shape[0] or bk[0] != 0 or bk[-1] != k.shape[0]:
        raise ValueError(
            f"attention: cu_seqlens must start at 0 and end at the token counts (q {q.shape[0]}, k {k.shape[0]}), "
            f"got q [{bq[0]}..{bq[-1]}], k [{bk[0]}..{bk[-1]}]"
        )
    if not pieces:
        return out
    # Rebuild with torch.cat (autograd-friendly, no in-place writes into a leaf-derived buffer).
    chunks, pos = [], 0
    for q0, q1, o in pieces:
        if q0 > pos:
            chunks.append(out[pos:q0])
        chunks.append(o)
        pos = q1
    if pos < q.shape[0]:
        chunks.append(out[pos:])
    return torch.cat(chunks, dim=0)
