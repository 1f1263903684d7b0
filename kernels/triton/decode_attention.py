"""Triton decode attention: one query token per sequence against its slot or paged KV cache.

Why a kernel: a decoding step reads every cached key once and does almost no arithmetic per byte, so
the torch backend (`kernels/reference/decode_attention.py`: gather the keys to `[B, S, Hkv, D]`, then
a masked SDPA) pays for a gather copy of the paged cache and for reading masked padding up to the
longest sequence, plus several launches per layer. Here each program reads only its own sequence's
keys, in place, in the cache's own strides, and the whole step is one launch.

Contract: `kernels/reference/decode_attention.py` (slot layout `[slots, max_len, Hkv, D]` + slot_ids,
or paged `[blocks, block_size, Hkv, D]` + block_table; `cache_seqlens` counts the keys of each
sequence, the new token's already written; `max_seqlen_k` bounds the keys read; a sequence without
keys outputs zeros). Both layouts go through one kernel: the slot layout is the paged one with a
one-column block table (the slot id) and blocks of `max_len` positions.

Algorithm: one program per (sequence, KV head) holds the query heads of that GQA group as a
`[group, D]` tile and walks the sequence's keys in blocks of `BLOCK_N` positions with an online
softmax (running max, running sum, fp32 accumulator; base-2 exponentials on pre-scaled scores).
Products are elementwise + row sums, not `tl.dot`: a group has 1-8 query rows, under the 16-row
minimum of `tl.dot`, and the step is bound by reading the cache anyway. Inference only (no backward).
Block sizes are untuned heuristics (written without a GPU; its bf16 tests passed on an H200, 2026-11-25,
benchmarks/RESULTS.md; its speed there is not measured yet).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.decode_attention import check_decode_attention_inputs
from .common import check_device, row_block

__all__ = ["decode_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_kernel(
    Q, K, V, O, SEQLENS, TABLE,
    sq_b, sq_h, sq_d,
    sk_blk, sk_pos, sk_h, sk_d,
    sv_blk, sv_pos, sv_h, sv_d,
    so_b, so_h, so_d,
    st_b, st_n,
    max_len, block_size, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    n = tl.minimum(tl.load(SEQLENS + b), max_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = hk * GROUP + offs_g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale_log2  # scores come out in log2 units: softmax by exp2
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < n
        blk = tl.load(TABLE + b * st_b + (pos // block_size) * st_n, mask=valid, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(K + (blk * sk_blk + off * sk_pos + hk * sk_h)[:, None] + offs_d[None, :] * sk_d,
                    mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(V + (blk * sv_blk + off * sv_pos + hk * sv_h)[:, None] + offs_d[None, :] * sv_d,
                    mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = tl.where(l_sum[:, None] > 0, acc / tl.maximum(l_sum, 1e-30)[:, None], 0.0)
    tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d, out.to(O.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    slot_ids: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """q `[B, Hq, D]` -> `[B, Hq, D]` in q's dtype (see the module docstring and the reference)."""
    check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table)
    check_device("decode_attention", q, k_cache, v_cache)
    batch, hq, dim = q.shape
    hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    if block_table is not None:
        table = block_table
        capacity = block_table.shape[1] * block_size
    else:  # the slot layout: one block of max_len positions per sequence
        ids = slot_ids if slot_ids is not None else torch.arange(batch, device=q.device)
        table = ids[:, None]
        capacity = block_size
    length = capacity if max_seqlen_k is None else min(int(max_seqlen_k), capacity)
    if batch == 0 or length <= 0:
        return torch.zeros_like(q)
    table = table.to(device=q.device, dtype=torch.int32)
    seqlens = cache_seqlens.to(device=q.device, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    group = hq // hkv
    _decode_attention_kernel[(batch, hkv)](
        q, k_cache, v_cache, out, seqlens, table,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *table.stride(),
        length, block_size, scale * _LOG2E,
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(2, triton.next_power_of_2(group)), BLOCK_D=row_block(dim),
        BLOCK_N=64, num_warps=4,
    )
    return out
