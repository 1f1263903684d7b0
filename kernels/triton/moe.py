"""Triton MoE ops: grouped (per-expert) matmul and unpermute-combine, forward and backward.

Contracts (layouts, group counts / offsets, row_map, fp32 accumulation) are those of
`kernels/reference/moe.py`; `moe_permute` stays on the reference (an argsort and an index_select:
torch's own kernels are already memory-bound and there is nothing to fuse).

grouped_mm: rows of expert e are the contiguous slice [start_e, end_e) of x. Both weight layouts
are handled through strides of one logical view B `[E, K, N]` (B = weight for "ekn",
weight.transpose(1, 2) for "enk"), so nothing is copied.
- Forward: a tile schedule is built from the group ends (one entry per (group, BLOCK_M rows)
  tile; groups with zero rows get none). The grid is (M tiles, N tiles); each program multiplies
  its rows by B[e] over K in BLOCK_K steps with an fp32 accumulator and stores in x's dtype.
  Rows past the last group (padding) are zero.
- dX = dY @ B[e]^T per group: the same kernel, with B's K and N strides swapped.
- dW: dB[e] = X_e^T @ dY_e, a grouped kernel with grid (E, K tiles, N tiles) whose programs loop
  over the rows of their expert (an expert without rows gets a zero gradient). It writes dW
  through the strides of the weight-shaped gradient, in the weight's layout and dtype.
fp32 inputs use `input_precision="ieee"` (no TF32), so fp32 results match torch's default
matmul. fp64 inputs are delegated to the reference (Triton's fp64 dot is not a hot path).
The group ends are read on the host (as the reference does) to size the grid. Backward passes
are first-order only (`once_differentiable`: a double backward is an error, not a silent zero).

moe_unpermute: one program per token gathers its k rows (row_map), weights them and sums in fp32
(TOPK is a compile-time constant). Backward, per token: d permuted[row_map[i]] = w_i * dOut[t]
(stored, not accumulated: row_map must be a permutation of the permuted rows, as moe_permute and
torch_npu produce; this is checked), and d topk_weights[t, j] = <dOut[t], permuted[row_map[i]]>
in fp32.
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..reference import moe as reference
from .common import _UPCAST_DOT, check_device, to_dtype  # _UPCAST_DOT: the interpreter's bf16 dot work-around


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _dot_acc(a, b, acc, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b (fp32 accumulator)."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _grouped_mm_fwd_kernel(
    X, B, Y, TILE_EXPERT, TILE_ROW, GROUP_END, N, K,
    stride_xm, stride_xk, stride_be, stride_bk, stride_bn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    row0 = tl.load(TILE_ROW + pid_m).to(tl.int64)
    row_end = tl.load(GROUP_END + e).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < row_end
    col_mask = cols < N
    x_ptrs = X + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    b_ptrs = B + e * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot_acc(x, b, acc, INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_bk
    y_ptrs = Y + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, to_dtype(acc, Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_dw_kernel(
    X, DY, DB, GROUP_START, GROUP_END, K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(GROUP_START + e).to(tl.int64)
    end = tl.load(GROUP_END + e).to(tl.int64)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    k_mask = ks < K
    col_mask = cols < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + ms
        row_mask = rows < end
        xt = tl.load(X + rows[None, :] * stride_xm + ks[:, None] * stride_xk, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot_acc(xt, dy, acc, INPUT_PRECISION)
    db_ptrs = DB + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    tl.store(db_ptrs, to_dtype(acc, DB.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


@triton.jit
def _moe_unpermute_fwd_kernel(
    P, ROW_MAP, WEIGHTS, OUT, H, stride_p, stride_o,
    TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(ROW_MAP + t * TOPK + j).to(tl.int64)
        p = tl.load(P + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            p = p * tl.load(WEIGHTS + t * TOPK + j).to(tl.float32)
        acc += p
    tl.store(OUT + t * stride_o + cols, to_dtype(acc, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _moe_unpermute_bwd_kernel(
    DOUT, P, ROW_MAP, WEIGHTS, DP, DWEIGHTS, H, stride_dout, stride_p, stride_dp,
    TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, NEED_DWEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    for j in tl.static_range(TOPK):
        row = tl.load(ROW_MAP + t * TOPK + j).to(tl.int64)
        w = 1.0
        if HAS_WEIGHTS:
            w = tl.load(WEIGHTS + t * TOPK + j).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs
            mask = cols < H
            dout = tl.load(DOUT + t * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DP + row * stride_dp + cols, to_dtype(dout * w, DP.dtype.element_ty), mask=mask)
            if NEED_DWEIGHTS:
                p = tl.load(P + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
                dot += dout * p
        if NEED_DWEIGHTS:
            tl.store(DWEIGHTS + t * TOPK + j, to_dtype(tl.sum(dot, 0), DWEIGHTS.dtype.element_ty))


# ------------------------------------------------------------------------------------- launchers
def _mm_blocks(x: torch.Tensor):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): small tiles in the interpreter (tests
    cover several tiles per group), untuned A100/H100-sized tiles on CUDA."""
    if x.device.type == "cpu":
        return 16, 16, 16, 4, 1
    return 64, 128, 32, 4, 3


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else None


def _schedule(ends: list[int], block_m: int, device: torch.device):
    """Tile schedule of the forward / dX kernel: (tile_expert, tile_row) int32 `[T]`, one per
    BLOCK_M rows of each non-empty group, plus group starts / ends int32 `[E]`. Built on the host
    from the group ends (already there for validation), moved in one copy."""
    ends_t = torch.tensor(ends, dtype=torch.int64)
    starts_t = torch.cat([ends_t.new_zeros(1), ends_t[:-1]]) if ends else ends_t
    tiles = (ends_t - starts_t + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(len(ends)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_row = starts_t[tile_expert] + (torch.arange(tile_expert.numel()) - first_tile[tile_expert]) * block_m
    packed = torch.cat([tile_expert, tile_row, starts_t, ends_t]).to(device=device, dtype=torch.int32)
    n_tiles, n_groups = tile_expert.numel(), len(ends)
    return packed[:n_tiles], packed[n_tiles: 2 * n_tiles], packed[2 * n_tiles: 2 * n_tiles + n_groups], packed[2 * n_tiles + n_groups:]


def _launch_mm(x, b_view, y, tile_expert, tile_row, group_end):
    """y[rows of e] = x[rows of e] @ b_view[e] (b_view `[E, K, N]`, any strides)."""
    n_out, k_in = b_view.shape[2], b_view.shape[1]
    if tile_expert.numel() == 0 or n_out == 0:
        return
    if k_in == 0:  # empty sums
        y[: int(group_end[-1])].zero_()
        return
    bm, bn, bk, warps, stages = _mm_blocks(x)
    grid = (tile_expert.numel(), triton.cdiv(n_out, bn))
    _grouped_mm_fwd_kernel[grid](
        x, b_view, y, tile_expert, tile_row, group_end, n_out, k_in,
        x.stride(0), x.stride(1), b_view.stride(0), b_view.stride(1), b_view.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INPUT_PRECISION=_precision(x.dtype), num_warps=warps, num_stages=stages,
    )


def _launch_dw(x, dy, db_view, group_start, group_end):
    """db_view[e] = x[rows of e]^T @ dy[rows of e] for every expert (zero for empty groups)."""
    n_experts, k_in, n_out = db_view.shape
    if n_experts == 0 or k_in == 0 or n_out == 0:
        return
    bm, bn, bk, warps, stages = _mm_blocks(x)
    grid = (n_experts, triton.cdiv(k_in, bk), triton.cdiv(n_out, bn))
    _grouped_mm_dw_kernel[grid](
        x, dy, db_view, group_start, group_end, k_in, n_out,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), db_view.stride(0), db_view.stride(1), db_view.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INPUT_PRECISION=_precision(x.dtype), num_warps=warps, num_stages=stages,
    )


def _logical(weight: torch.Tensor, weight_layout: str) -> torch.Tensor:
    """The `[E, K, N]` view of weight (a transpose view for "enk", no copy)."""
    return weight if weight_layout == "ekn" else weight.transpose(1, 2)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_layout, tile_expert, tile_row, group_start, group_end, covered):
        b_view = _logical(weight, weight_layout)
        y = torch.empty(x.shape[0], b_view.shape[2], dtype=x.dtype, device=x.device)
        y[covered:].zero_()  # padding rows past the last group
        _launch_mm(x, b_view, y, tile_expert, tile_row, group_end)
        ctx.save_for_backward(x, weight, tile_expert, tile_row, group_start, group_end)
        ctx.weight_layout, ctx.covered = weight_layout, covered
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, tile_expert, tile_row, group_start, group_end = ctx.saved_tensors
        b_view = _logical(weight, ctx.weight_layout)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            dx[ctx.covered:].zero_()
            _launch_mm(dy, b_view.transpose(1, 2), dx, tile_expert, tile_row, group_end)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(weight)  # every expert's block is written (zeros for empty groups)
            _launch_dw(x, dy, _logical(dw, ctx.weight_layout), group_start, group_end)
        return dx, dw, None, None, None, None, None, None


class _MoEUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted_out, row_map, topk_weights, topk):
        n_tokens, hidden = row_map.numel() // topk if topk else 0, permuted_out.shape[1]
        out = torch.empty(n_tokens, hidden, dtype=permuted_out.dtype, device=permuted_out.device)
        if n_tokens and hidden:
            block = min(1024, triton.next_power_of_2(hidden))
            has_w = topk_weights is not None
            _moe_unpermute_fwd_kernel[(n_tokens, triton.cdiv(hidden, block))](
                permuted_out, row_map, topk_weights if has_w else row_map, out, hidden,
                permuted_out.stride(0), out.stride(0), TOPK=topk, HAS_WEIGHTS=has_w, BLOCK_H=block,
            )
        ctx.save_for_backward(permuted_out, row_map, topk_weights)
        ctx.topk = topk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        permuted_out, row_map, topk_weights = ctx.saved_tensors
        topk, hidden = ctx.topk, permuted_out.shape[1]
        n_tokens = row_map.numel() // topk if topk else 0
        has_w = topk_weights is not None
        need_dw = has_w and ctx.needs_input_grad[2]
        dp = torch.empty_like(permuted_out) if n_tokens and hidden else torch.zeros_like(permuted_out)
        dweights = None
        if need_dw:
            dweights = torch.empty_like(topk_weights) if n_tokens and hidden else torch.zeros_like(topk_weights)
        if n_tokens and hidden:
            dout = dout.contiguous()
            block = min(1024, triton.next_power_of_2(hidden))
            _moe_unpermute_bwd_kernel[(n_tokens,)](
                dout, permuted_out, row_map, topk_weights if has_w else row_map, dp,
                dweights if need_dw else dp, hidden, dout.stride(0), permuted_out.stride(0), dp.stride(0),
                TOPK=topk, HAS_WEIGHTS=has_w, NEED_DWEIGHTS=need_dw, BLOCK_H=block,
            )
        return dp, None, dweights, None


# ------------------------------------------------------------------------------ public functions
def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tokens_per_expert: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    weight_layout: str = "ekn",
) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups on the Triton kernels; same contract and errors
    as `kernels.reference.moe.grouped_mm`; differentiable w.r.t. x and weight."""
    ends = reference.grouped_mm_group_ends(x, weight, tokens_per_expert, offsets, weight_layout)
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_mm: x dtype {x.dtype} != weight dtype {weight.dtype}")
    if x.dtype == torch.float64:
        return reference.grouped_mm(x, weight, tokens_per_expert=tokens_per_expert, offsets=offsets, weight_layout=weight_layout)
    check_device("grouped_mm", x, weight)
    covered = ends[-1] if ends else 0
    schedule = _schedule(ends, _mm_blocks(x)[0], x.device)
    return _GroupedMM.apply(x, weight, weight_layout, *schedule, covered)


def moe_unpermute(
    permuted_out: torch.Tensor,
    row_map: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    *,
    topk: Optional[int] = None,
) -> torch.Tensor:
    """Gather + weighted sum of each token's k expert rows on the Triton kernels (fp32
    accumulation, output in permuted_out's dtype); same contract as the reference, with the
    extra requirement that row_map is a permutation of the permuted rows (moe_permute's output)."""
    if row_map.is_floating_point():
        raise ValueError(f"moe_unpermute: row_map must be an integer tensor, got {row_map.dtype}")
    if topk_weights is None and topk is not None and topk < 1:
        raise ValueError(f"moe_unpermute: {row_map.numel()} rows do not split into groups of topk={topk}")
    k = reference.moe_unpermute_topk(permuted_out, row_map, topk_weights, topk)
    if topk_weights is not None:
        topk_weights = topk_weights.contiguous()
    if permuted_out.dtype == torch.float64:
        return reference.moe_unpermute(permuted_out, row_map, topk_weights, topk=topk)
    check_device("moe_unpermute", permuted_out, row_map)
    n_rows = row_map.numel()
    if n_rows and not torch.equal(torch.sort(row_map.long()).values, torch.arange(n_rows, device=row_map.device)):
        raise ValueError(
            f"moe_unpermute: the triton backend needs row_map to be a permutation of 0..{n_rows - 1} "
            "(as moe_permute returns); use the torch backend for repeated or missing rows"
        )
    if permuted_out.stride(-1) != 1:
        permuted_out = permuted_out.contiguous()
    return _MoEUnpermute.apply(permuted_out, row_map.contiguous(), topk_weights, k)
