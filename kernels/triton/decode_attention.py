"""Triton decode attention: one query token per sequence against its slot or paged KV cache.

Why a kernel: a decoding step reads every cached key once and does almost no arithmetic per byte, so
the torch backend (`kernels/reference/decode_attention.py`: gather the keys to `[B, S, Hkv, D]`, then
a masked SDPA) pays for a gather copy of the paged cache and for reading masked padding up to the
longest sequence. Here each program reads only its share of one sequence's keys, in place, in the
cache's own strides.

Contract: `kernels/reference/decode_attention.py` (slot layout `[slots, max_len, Hkv, D]` + slot_ids,
or paged `[blocks, block_size, Hkv, D]` + block_table; `cache_seqlens` counts the keys of each
sequence, the new token's already written; `max_seqlen_k` bounds the keys read; a sequence without
keys outputs zeros). Both layouts go through one kernel: the slot layout is the paged one with a
one-column block table (the slot id) and blocks of `max_len` positions. Block (or slot) ids are device values,
so a wrong one cannot raise without a host sync per call; instead a key whose id lies outside the cache is
never read and its sequence's output comes out NaN (which the sampler refuses), not values of other memory.

Algorithm (split-K "flash decoding"): the keys of a sequence are cut into `splits` chunks so that
batch x kv heads x splits programs fill the GPU (a decode batch has only batch x kv heads = e.g. 32
(sequence, kv head) pairs, a quarter of an H100's 132 SMs). A program holds the query heads of one GQA
group as a `[16, D]` tile (the group's 1-8 rows padded to `tl.dot`'s 16-row minimum with zero rows:
the step is bound by reading the cache, the padded rows cost no memory traffic) and walks its chunk in
blocks of `BLOCK_N` keys with an online softmax (running max, running sum, fp32 accumulator, base-2
exponentials), both products on the tensor cores (`tl.dot`; fp32 inputs in IEEE precision, not TF32).
With one split it writes the output; otherwise each writes its normalised partial output and base-2
log-sum-exp, and a second kernel merges the splits of each (sequence, head).

Shared prompts (`shared_prefix=(rows, lens)`, the hint of the slot caches): the first `lens[b]` keys of
sequence b are read from the copy of its group's root row `rows[b]` (through the root's slot id / block-table
row), so the G programs of one GRPO group with the same (kv head, split) read the same addresses; they are
adjacent in launch order (the sequence is the grid's fastest axis), and the repeats are served from L2 instead
of HBM. One load and one select per key block; no host read of the hint (the CUDA-graph steps pass it in static
buffers). The promise is trusted, not checked (a check would read the hint on the host every call); the
prefix read is only bounded by both rows' lengths. Whether it pays is measured by
`benchmarks/e2e/profile_decode.py` (the shared-prompt variants).

History: the first version (one program per (sequence, kv head), products as elementwise `[G, N, D]`
register tiles reduced by `tl.sum`) took 3.0 ms per call on an H100 at 16 sequences x 1.1k keys
(16 / 2 heads, D 128, bf16): 93 % of a decode step, 3.3x slower per step than the torch backend
(benchmarks/RESULTS.md, 2026-11-26). This split-K version, in whole decode steps of the same shape on an H200
(2026-11-27): 5.92 ms per step with CUDA graphs vs 7.61 ms with the torch backend, so `auto` takes it on CUDA.
Inference only (no backward): a call whose inputs require gradients runs the torch backend.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.decode_attention import check_decode_attention_inputs
from ..reference.decode_attention import decode_attention as _torch_decode_attention
from .common import INTERPRETED_AT_IMPORT, check_device, dot, row_block, to_dtype

__all__ = ["decode_attention", "num_splits"]

_LOG2E = 1.4426950408889634
_BLOCK_N = 16 if INTERPRETED_AT_IMPORT else 64
"""Keys per inner step (the interpreter's smaller blocks make the tests' short caches span several splits)."""
_INTERPRETER_SMS = 8
"""Stand-in SM count when interpreted (CPU tests): small enough that the tests' shapes split."""
_MERGE_BLOCK = 2 if INTERPRETED_AT_IMPORT else 16
"""Splits merged per step of the merge kernel's loop (the interpreter's 2 makes the tests loop)."""


@triton.jit
def _decode_attention_split_kernel(
    Q, K, V, O, MID_O, MID_LSE, SEQLENS, TABLE, PREFIX_ROWS, PREFIX_LENS,  # noqa: E741 -- Q, K, V, O as in the attention equations
    sq_b, sq_h, sq_d,
    sk_blk, sk_pos, sk_h, sk_d,
    sv_blk, sv_pos, sv_h, sv_d,
    so_b, so_h, so_d,
    st_b, st_n,
    max_len, block_size, n_blocks, chunk, splits, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, IEEE: tl.constexpr, SHARED: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.minimum(tl.load(SEQLENS + b), max_len)
    if SHARED:  # the first `shared` keys are read from the root row's copy (module docstring)
        root = tl.load(PREFIX_ROWS + b)
        shared = tl.minimum(tl.minimum(tl.load(PREFIX_LENS + b), n), tl.load(SEQLENS + root))
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = hk * GROUP + offs_g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    outside = 0  # keys whose block (or slot) id lies outside the cache: never read, the row's output made NaN
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        if SHARED:
            row = tl.where(pos < shared, root, b)
            blk = tl.load(TABLE + row * st_b + (pos // block_size) * st_n, mask=valid, other=0).to(tl.int64)
        else:
            blk = tl.load(TABLE + b * st_b + (pos // block_size) * st_n, mask=valid, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        bad = valid & ((blk < 0) | (blk >= n_blocks))
        outside += tl.sum(bad.to(tl.int32), axis=0)
        valid = valid & ((blk >= 0) & (blk < n_blocks))
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(K + (blk * sk_blk + off * sk_pos + hk * sk_h)[:, None] + offs_d[None, :] * sk_d,
                    mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), IEEE)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [G, N], log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # guard: an all -inf row would give NaN, not 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(V + (blk * sv_blk + off * sv_pos + hk * sv_h)[:, None] + offs_d[None, :] * sv_d,
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(to_dtype(p, v.dtype), v, IEEE)  # bf16: P rounded once, as in flash attention
        m = m_new
    out = tl.where(l_sum[:, None] > 0, acc / tl.maximum(l_sum, 1e-30)[:, None], 0.0)
    out = tl.where(outside > 0, float("nan"), out)  # a block table pointing outside the cache: NaN, not other memory
    if ONE_SPLIT:
        tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d, out.to(O.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials: MID_O [B, Hq, splits, BLOCK_D] fp32, MID_LSE [B, Hq, splits] fp32 (contiguous)
        row = (b * (tl.num_programs(1) * GROUP) + heads) * splits + split
        tl.store(MID_O + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(l_sum > 0, m + tl.log2(tl.maximum(l_sum, 1e-30)), float("-inf"))
        tl.store(MID_LSE + row, lse, mask=g_ok)


@triton.jit
def _decode_attention_merge_kernel(
    O, MID_O, MID_LSE, splits, so_b, so_h, so_d,  # noqa: E741 -- O: the attention output, as above
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse), over the splits in blocks of BLOCK_S (online:
    running max, running weight sum and output rescaled per block); no key anywhere: zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row0 = (b * tl.num_programs(1) + h) * splits
    m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < splits
        lse = tl.load(MID_LSE + row0 + offs_s, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # m = -inf (nothing yet): 0, and acc / total are still 0
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_safe))
        parts = tl.load(MID_O + (row0 + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * parts, axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / tl.maximum(total, 1e-30)  # total 0 (no key anywhere): acc is 0 too, zeros
    tl.store(O + b * so_b + h * so_h + offs_d * so_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def num_splits(pairs: int, length: int, sm_count: int, block_n: int = _BLOCK_N) -> tuple[int, int]:
    """(splits, keys per split) for `pairs` (sequence, kv head) programs over caches of up to `length` keys:
    enough splits for ~2 programs per SM, none shorter than one key block, chunks a whole number of blocks.
    Depends on host integers only (a CUDA-graph capture of a decode step replays the same grid)."""
    blocks = max(1, -(-length // block_n))
    want = max(1, -(-2 * sm_count // max(pairs, 1)))
    per_split = -(-blocks // min(want, blocks))
    chunk = per_split * block_n
    return -(-length // chunk), chunk


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
    shared_prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """q `[B, Hq, D]` -> `[B, Hq, D]` in q's dtype (see the module docstring and the reference; the keys of a
    `shared_prefix` are read from the root row's copy, without a host read of the hint)."""
    check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, shared_prefix)
    check_device("decode_attention", q, k_cache, v_cache)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        # no backward here: the torch backend keeps the graph (an output from the kernel would carry no gradient)
        return _torch_decode_attention(q, k_cache, v_cache, cache_seqlens, slot_ids=slot_ids, block_table=block_table,
                                       max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale)
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
    block_d = row_block(dim)
    splits, chunk = num_splits(batch * hkv, length, _sm_count(q.device))
    if splits > 1:
        mid_o = torch.empty(batch, hq, splits, block_d, device=q.device, dtype=torch.float32)
        mid_lse = torch.empty(batch, hq, splits, device=q.device, dtype=torch.float32)
    else:
        mid_o = mid_lse = out  # unused
    if shared_prefix is not None:
        prefix_rows, prefix_lens = (t.to(device=q.device, dtype=torch.int32) for t in shared_prefix)
    else:
        prefix_rows = prefix_lens = seqlens  # unused
    _decode_attention_split_kernel[(batch, hkv, splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, seqlens, table, prefix_rows, prefix_lens,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *table.stride(),
        length, block_size, k_cache.shape[0], chunk, splits, scale * _LOG2E,
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N, ONE_SPLIT=splits == 1, IEEE=q.dtype == torch.float32, SHARED=shared_prefix is not None,
        num_warps=4,
    )
    if splits > 1:  # the split count is a runtime argument: a growing cache does not compile new kernels
        _decode_attention_merge_kernel[(batch, hq)](
            out, mid_o, mid_lse, splits, *out.stride(),
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=_MERGE_BLOCK, num_warps=4,
        )
    return out
