"""Triton LayerNorm over the last dim (forward + backward), weight and bias optional.

Used by the vision towers (Qwen2.5-VL merger, InternViT) and projectors. fp32 statistics, biased
variance as nn.LayerNorm. Backward with xhat = (x - mean) * rstd, dxhat = dy * w:
  dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dw = sum dy * xhat, db = sum dy,
the weight / bias sums reduced from per-program fp32 partials.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import check_device, num_warps_for, row_block, to_dtype


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, n_rows, n_cols, stride_x, stride_y, eps, rows_per_program,
    BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, 0) / n_cols
            xc = tl.where(mask, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
            y = xc * rstd
            if HAS_WEIGHT:
                y = y * w
            if HAS_BIAS:
                y = y + b
            tl.store(MEAN + row, mean)
            tl.store(RSTD + row, rstd)
            tl.store(Y + row * stride_y + cols, to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, stride_dy, stride_x, stride_dx,
    rows_per_program, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dxhat = dy
            if HAS_WEIGHT:
                dxhat = dy * w
            dw += dy * xhat
            db += dy
            dx = rstd * (dxhat - tl.sum(dxhat, 0) / n_cols - xhat * (tl.sum(dxhat * xhat, 0) / n_cols))
            tl.store(DX + row * stride_dx + cols, to_dtype(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=mask)


def _launch_shape(n_rows: int, x: torch.Tensor, persistent: bool) -> tuple[int, int]:
    if x.device.type == "cpu":
        programs = 4
    elif not persistent:
        return 1, n_rows
    else:
        programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = max(1, triton.cdiv(n_rows, programs))
    return rows, triton.cdiv(n_rows, rows)


@torch.library.custom_op("megatron_vlm::triton_layer_norm_fwd", mutates_args=())
def layer_norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block = row_block(n_cols)
        rows, programs = _launch_shape(n_rows, x, persistent=False)
        _layer_norm_fwd_kernel[(programs,)](
            x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd,
            n_rows, n_cols, x.stride(0), y.stride(0), eps, rows,
            BLOCK=block, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=num_warps_for(block),
        )
    return y, mean, rstd


@layer_norm_fwd_op.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty((x.shape[0],), dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("megatron_vlm::triton_layer_norm_bwd", mutates_args=())
def layer_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    n_rows, n_cols = x.shape
    dx = torch.empty_like(x)
    block = row_block(n_cols)
    rows, programs = _launch_shape(max(n_rows, 1), x, persistent=True)
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    db_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows:
        _layer_norm_bwd_kernel[(programs,)](
            dy, x, weight if weight is not None else x, mean, rstd, dx, dw_partial, db_partial,
            n_rows, n_cols, dy.stride(0), x.stride(0), dx.stride(0), rows,
            BLOCK=block, HAS_WEIGHT=weight is not None, num_warps=num_warps_for(block),
        )
    return dx, dw_partial.sum(0), db_partial.sum(0)


@layer_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd):
    stat = x.new_empty((x.shape[1],), dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


def _setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.weight_dtype = None if weight is None else weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd_op(dy, x, weight, mean, rstd)
    dw = None if ctx.weight_dtype is None else dw.to(ctx.weight_dtype)
    db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
    return dx, dw, db, None


layer_norm_fwd_op.register_autograd(_backward, setup_context=_setup)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Public-signature LayerNorm on the Triton kernels."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (x.shape[-1],):
            raise ValueError(f"layer_norm: {name} shape {tuple(t.shape)} does not match hidden size {x.shape[-1]}")
    check_device("layer_norm", x)
    shape = x.shape
    x2d = x.reshape(-1, shape[-1]).contiguous()
    y, _, _ = layer_norm_fwd_op(
        x2d, None if weight is None else weight.contiguous(), None if bias is None else bias.contiguous(), float(eps)
    )
    return y.reshape(shape)
