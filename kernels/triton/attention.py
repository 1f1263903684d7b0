"""Triton flash attention (forward + backward): varlen cu_seqlens, GQA / MQA, causal, local windows.

Algorithm (FlashAttention-2): the forward walks key blocks with an online softmax (running max
`m`, running sum `l`, fp32 accumulator) and stores the per-row log-sum-exp (base 2, in units of
the scaled scores) for the backward. The backward recomputes probabilities from it: one kernel per
key block accumulates dK / dV over the query blocks of every query head of its KV group (no
atomics for GQA), another per query block accumulates dQ. Only the key (query) blocks a window or
the causal mask can reach are visited.

Layout inside the kernels is always packed `[T, H, D]` with int32 cu_seqlens; the batched
`[B, S, H, D]` layout is a reshape with uniform cu_seqlens plus an optional key padding mask
(`[B, Sk]`, nonzero = keep). Head dims that are not powers of two (72, 80, 96) are padded to the
next power of two with masked loads. Masks and alignment follow `kernels/reference/attention.py`:
query i sits at key position i + Sk - Sq; causal = window right side 0; rows that see no key
output zeros (their lse is +inf so the backward gives them zero gradient).

Block sizes are fixed (see `_config`: picked on an H200 among a few configs, not autotuned). Measured
there (fwd + bwd, bf16), this kernel takes 2.3x (LM shape) to 4x (D-80 vision shape) the time of torch's
flash SDPA on dense batches (benchmarks/RESULTS.md), so a dense block in half precision on CUDA (a batch
without padding mask or window, a one-sample pack) is handed to torch's SDPA (`_dense_for_sdpa`);
packs of several samples and windows, where SDPA needs a mask, stay here.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.attention import packed_max_seqlens, prepare_attention_args
from .common import check_device, to_dtype

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """tl.dot; UPCAST_DOT works around the Triton 3.9 interpreter multiplying bf16 operands as their
    raw uint16 bits (interpreter.py create_dot): exact here, since bf16 products fit in fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT_PRECISION == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _visible(rows, cols, diag, k_len, left, right):
    """[BM, BN] True where query row i may see key col j (bottom-right aligned, -1 = unbounded)."""
    i = rows[:, None] + diag
    j = cols[None, :]
    vis = j < k_len
    vis = vis & ((left < 0) | (j >= i - left))
    vis = vis & ((right < 0) | (j <= i + right))
    return vis


@triton.jit
def _fully_visible(m0, n0, diag, k_len, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True when every (row, col) of the block is visible, so the mask can be skipped (interior blocks)."""
    ok = n0 + BLOCK_N <= k_len
    ok = ok & ((right < 0) | (n0 + BLOCK_N - 1 <= m0 + diag + right))
    ok = ok & ((left < 0) | (n0 >= m0 + BLOCK_M - 1 + diag - left))
    return ok


@triton.jit
def _key_range(m0, diag, k_len, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks [lo, hi) that rows m0 .. m0 + BLOCK_M - 1 can reach; lo aligned to BLOCK_N."""
    lo = m0 * 0
    if left >= 0:
        lo = tl.maximum(m0 + diag - left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = k_len + m0 * 0
    if right >= 0:
        hi = tl.minimum(m0 + BLOCK_M + diag + right, k_len)
    return lo, hi


@triton.jit
def _query_range(n0, diag, q_len, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks [lo, hi) that can see keys n0 .. n0 + BLOCK_N - 1; lo aligned to BLOCK_M."""
    lo = n0 * 0
    if right >= 0:
        lo = tl.maximum(n0 - diag - right, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = q_len + n0 * 0
    if left >= 0:
        hi = tl.minimum(n0 + BLOCK_N - diag + left, q_len)
    return lo, hi


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, KPM,  # noqa: E741 -- Q, K, V, O as in the attention equations
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, stride_kpm_b,
    qk_scale, left, right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    diag = k_len - q_len
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = rows < q_len
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(m0, diag, k_len, left, right, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        mask_n = cols < k_len
        kt = tl.load(
            K + (k_start + cols)[None, :] * stride_kt + hk * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None], other=0.0,
        )
        s = _dot(q, kt, DOT_PRECISION, UPCAST_DOT) * qk_scale
        if HAS_KPM:
            keep = tl.load(KPM + b * stride_kpm_b + cols, mask=mask_n, other=0)
            s = tl.where(_visible(rows, cols, diag, k_len, left, right) & (keep[None, :] != 0), s, float("-inf"))
        elif _fully_visible(m0, n0, diag, k_len, left, right, BLOCK_M, BLOCK_N) == 0:
            s = tl.where(_visible(rows, cols, diag, k_len, left, right), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + (k_start + cols)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(to_dtype(p, v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        O + (q_start + rows)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        to_dtype(out, O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE + h * stride_lse_h + q_start + rows, lse, mask=mask_m)


@triton.jit
def _attention_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, KPM,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_lse_h, stride_kpm_b,
    qk_scale, sm_scale, left, right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """dK, dV for one key block of one KV head, summed over the GROUP query heads sharing it."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    diag = k_len - q_len
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = cols < k_len
    mask_d = offs_d < HEAD_DIM
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + (k_start + cols)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + cols)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    keep = mask_n
    if HAS_KPM:
        keep = keep & (tl.load(KPM + b * stride_kpm_b + cols, mask=mask_n, other=0) != 0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_range(n0, diag, q_len, left, right, BLOCK_M, BLOCK_N)
    for g in range(GROUP):
        h = hk * GROUP + g
        for m0 in range(lo, hi, BLOCK_M):
            rows = m0 + offs_m
            mask_m = rows < q_len
            q_mask = mask_m[:, None] & mask_d[None, :]
            q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + (q_start + rows)[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + h * stride_lse_h + q_start + rows, mask=mask_m, other=float("inf"))
            delta = tl.load(DELTA + h * stride_lse_h + q_start + rows, mask=mask_m, other=0.0)
            s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale
            # rows past q_len have lse = +inf, so their p is 0 without a mask
            p = tl.math.exp2(s - lse[:, None])
            if HAS_KPM:
                p = tl.where(_visible(rows, cols, diag, k_len, left, right) & keep[None, :], p, 0.0)
            elif _fully_visible(m0, n0, diag, k_len, left, right, BLOCK_M, BLOCK_N) == 0:
                p = tl.where(_visible(rows, cols, diag, k_len, left, right), p, 0.0)
            dv += _dot(tl.trans(to_dtype(p, do.dtype)), do, DOT_PRECISION, UPCAST_DOT)
            dp = _dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(to_dtype(ds, q.dtype)), q, DOT_PRECISION, UPCAST_DOT)
    dk = dk * sm_scale
    tl.store(DK + (k_start + cols)[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], to_dtype(dk, DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + (k_start + cols)[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :], to_dtype(dv, DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, KPM,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    stride_lse_h, stride_kpm_b,
    qk_scale, sm_scale, left, right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """dQ for one query block of one query head."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // GROUP
    diag = k_len - q_len
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = rows < q_len
    mask_d = offs_d < HEAD_DIM
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + (q_start + rows)[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + h * stride_lse_h + q_start + rows, mask=mask_m, other=float("inf"))
    delta = tl.load(DELTA + h * stride_lse_h + q_start + rows, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(m0, diag, k_len, left, right, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        mask_n = cols < k_len
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + (k_start + cols)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + (k_start + cols)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if HAS_KPM:
            keep = tl.load(KPM + b * stride_kpm_b + cols, mask=mask_n, other=0)
            p = tl.where(_visible(rows, cols, diag, k_len, left, right) & (keep[None, :] != 0), p, 0.0)
        elif _fully_visible(m0, n0, diag, k_len, left, right, BLOCK_M, BLOCK_N) == 0:
            p = tl.where(_visible(rows, cols, diag, k_len, left, right), p, 0.0)
        dp = _dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(to_dtype(ds, k.dtype), k, DOT_PRECISION, UPCAST_DOT)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + rows)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], to_dtype(dq, DQ.dtype.element_ty), mask=q_mask)


def _config(q: torch.Tensor, block_d: int) -> dict:
    """Block sizes / warps. Interpreter: large blocks (fewer Python-level steps).

    GPU, chosen on an H200 (Triton 3.6, torch 2.11) among six configs by the compiled tests and a timing:
    the FA2 tutorial values first used here (dK/dV blocks 32 x 128, 8 warps for D >= 128, 3 stages) gave
    a wrong dK (max error 1.1) for bf16, D = 80 padded to 128, with a non-causal window; so did 64 x 128 with
    8 warps and 3 stages, while every config with 4 warps or 1 stage passed. 64 x 64, 4 warps, 1 stage
    passed all attention tests and was the fastest of those timed (fwd + bwd, bf16: 1.44 ms vs 1.66 ms for
    4 x 2048 tokens, 16 / 2 heads, D 128, causal; 0.99 ms vs 1.04 ms for a D-80 vision shape).
    """
    if q.device.type == "cpu":
        return dict(fwd=(64, 64), dkdv=(64, 64), dq=(64, 64), num_warps=4, num_stages=1)
    return dict(fwd=(128, 64), dkdv=(64, 64), dq=(128, 32), num_warps=4, num_stages=1)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dots (tf32 would make fp32 attention less accurate than the reference);
    # fp16 / bf16: the default (tensor cores, fp32 accumulation).
    return "ieee" if dtype == torch.float32 else "default"


def _upcast_dot(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def _kpm_args(kpm: Optional[torch.Tensor], fallback: torch.Tensor):
    return (kpm, kpm.stride(0), True) if kpm is not None else (fallback, 0, False)


def attention_fwd(q, k, v, cu_q, cu_k, kpm, max_q: int, scale: float, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on packed [T, H, D] tensors; returns (out, lse [Hq, Tq] fp32, base 2)."""
    t_q, hq, d = q.shape
    hkv = k.shape[1]
    batch = cu_q.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty((hq, t_q), dtype=torch.float32, device=q.device)
    if t_q == 0 or batch == 0:
        return out, lse
    block_d = max(16, triton.next_power_of_2(d))
    cfg = _config(q, block_d)
    bm, bn = cfg["fwd"]
    kpm_t, kpm_stride, has_kpm = _kpm_args(kpm, cu_q)
    grid = (triton.cdiv(max(max_q, 1), bm), batch, hq)
    _attention_fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k, kpm_t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), kpm_stride,
        scale * _LOG2E, left, right,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, HAS_KPM=has_kpm,
        DOT_PRECISION=_precision(q.dtype), UPCAST_DOT=_upcast_dot(q), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out, lse


def attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, kpm, max_q: int, max_k: int, scale: float, left: int, right: int):
    """Launch the backward; returns (dq, dk, dv) in the input layouts."""
    t_q, hq, d = q.shape
    hkv = k.shape[1]
    batch = cu_q.numel() - 1
    do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if batch == 0 or (t_q == 0 and k.shape[0] == 0):
        return dq, dk, dv
    # delta_i = sum_d dO_i * O_i (the softmax-backward row term), fp32 [Hq, Tq].
    delta = (do.float() * out.float()).sum(-1).t().contiguous()
    block_d = max(16, triton.next_power_of_2(d))
    cfg = _config(q, block_d)
    kpm_t, kpm_stride, has_kpm = _kpm_args(kpm, cu_q)
    common = dict(
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, HAS_KPM=has_kpm, DOT_PRECISION=_precision(q.dtype),
        UPCAST_DOT=_upcast_dot(q), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    bm, bn = cfg["dkdv"]
    _attention_bwd_kernel[(triton.cdiv(max(max_k, 1), bn), batch, hkv)](
        q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, kpm_t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), kpm_stride,
        scale * _LOG2E, scale, left, right, BLOCK_M=bm, BLOCK_N=bn, **common,
    )
    bm, bn = cfg["dq"]
    _attention_bwd_dq_kernel[(triton.cdiv(max(max_q, 1), bm), batch, hq)](
        q, k, v, do, lse, delta, dq, cu_q, cu_k, kpm_t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1),
        lse.stride(0), kpm_stride,
        scale * _LOG2E, scale, left, right, BLOCK_M=bm, BLOCK_N=bn, **common,
    )
    return dq, dk, dv


# ---- torch.library custom ops (torch.compile traces through them; autograd via register_autograd) ----


@torch.library.custom_op("megatron_vlm::triton_attention_fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    kpm: Optional[torch.Tensor], max_q: int, max_k: int, scale: float, left: int, right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_fwd(q, k, v, cu_q, cu_k, kpm, max_q, scale, left, right)


@attention_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, kpm, max_q, max_k, scale, left, right):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("megatron_vlm::triton_attention_bwd", mutates_args=())
def attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, kpm: Optional[torch.Tensor], max_q: int, max_k: int, scale: float,
    left: int, right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, kpm, max_q, max_k, scale, left, right)


@attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, cu_q, cu_k, kpm, max_q, max_k, scale, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, kpm, max_q, max_k, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, kpm)
    ctx.args = (max_q, max_k, scale, left, right)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, kpm = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, kpm, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


DENSE_TO_SDPA = True
"""Hand dense blocks to SDPA (`_dense_for_sdpa`); the benchmark and the GPU tests turn it off to time / test the kernel."""


def _dense_for_sdpa(q, k, left, right, causal, cu_seqlens_q, key_padding_mask) -> bool:
    """Whether this call is one dense block that torch's fused SDPA (cuDNN / flash) runs unmasked, and faster:
    a batch without padding mask or window (same query and key lengths when causal), or a pack of one sample of
    equal query and key lengths, in half precision on CUDA. Measured on an H100 (bf16, 8k causal, 28 / 4 heads,
    D 128): SDPA 0.84 / 2.46 ms fwd / bwd, this kernel 1.64 / 5.23 ms (benchmarks/RESULTS.md, 2026-11-26).
    Packs of several samples and windows stay here (4-53x SDPA with the mask they would need)."""
    if not DENSE_TO_SDPA or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (left < 0 and (right < 0 or (causal and right == 0))) or key_padding_mask is not None:
        return False
    if q.dim() == 4:
        return not causal or q.shape[1] == k.shape[1]  # causal SDPA aligns top-left, ours bottom-right
    return cu_seqlens_q.numel() == 2 and q.shape[0] == k.shape[0]  # one sample of equal lengths


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
    """Public-signature attention on the Triton kernels (contract: kernels/reference/attention.py)."""
    cu_seqlens_q, cu_seqlens_k, left, right, scale = prepare_attention_args(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, window=window,
        softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )
    check_device("attention", q, k, v)
    if _dense_for_sdpa(q, k, left, right, causal, cu_seqlens_q, key_padding_mask):
        from ..sdpa.attention import _sdpa

        # straight to SDPA on [B, H, S, D] views, no mask; a valid one-sample pack is cu_seqlens [0, T] (the
        # contract: they end at the token count), so they are not read on the host (no sync per layer)
        qt, kt, vt = (t.transpose(1, 2) if q.dim() == 4 else t.transpose(0, 1)[None] for t in (q, k, v))
        out = _sdpa(qt, kt, vt, None, scale, is_causal=causal)
        return out.transpose(1, 2) if q.dim() == 4 else out[0].transpose(0, 1)
    batched = q.dim() == 4
    if batched:
        bsz, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
        q = q.reshape(bsz * s_q, q.shape[2], q.shape[3])
        k = k.reshape(bsz * s_k, k.shape[2], k.shape[3])
        v = v.reshape(bsz * s_k, v.shape[2], v.shape[3])
        steps = torch.arange(bsz + 1, device=q.device, dtype=torch.int32)
        cu_seqlens_q, cu_seqlens_k = steps * s_q, steps * s_k
        max_seqlen_q, max_seqlen_k = s_q, s_k
        kpm = key_padding_mask.to(torch.uint8).contiguous() if key_padding_mask is not None else None
    else:
        kpm = None
        # hints given on CUDA or under torch.compile: trusted (no host sync per layer, no graph break); else one
        # sync that also validates cu_seqlens
        max_seqlen_q, max_seqlen_k = packed_max_seqlens(
            cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
            check_hints=q.device.type == "cpu" and not torch.compiler.is_compiling(),
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, _ = attention_fwd_op(
        q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), kpm,
        int(max_seqlen_q), int(max_seqlen_k), scale, left, right,
    )
    return out.reshape(bsz, s_q, out.shape[1], out.shape[2]) if batched else out
