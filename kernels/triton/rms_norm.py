"""Triton RMSNorm with optional fused residual add (forward + backward).

One program normalises a group of rows, a whole row held in registers (hidden sizes up to a few
thousand: 1280 / 2048 / 3584 / 4096 ...). Statistics are fp32. With a residual, the kernel writes
the rounded sum `x + residual` (the next residual stream) and normalises that rounded sum, so the
fused path equals `h = x + residual; rms_norm(h)` (contract: kernels/reference/norms.py).

Backward, with xhat = s * rstd and dxhat = dy * w:
  ds = rstd * (dxhat - xhat * mean(dxhat * xhat)) (+ the gradient arriving at the summed output),
  dw = sum over rows of dy * xhat (per-program partial sums, reduced in torch);
the residual and x both receive ds.
"""
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from .common import check_device, direct_launch, num_warps_for, row_block, to_dtype


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD, n_rows, n_cols, stride_x, stride_r, stride_y, stride_s, eps,
    rows_per_program, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
                x = to_dtype((x.to(tl.float32) + r.to(tl.float32)), X.dtype.element_ty)
                tl.store(S + row * stride_s + cols, x, mask=mask)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
            tl.store(RSTD + row, rstd)
            tl.store(Y + row * stride_y + cols, to_dtype((xf * rstd * w), Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DS_IN, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, stride_dy, stride_dsin, stride_x, stride_dx,
    rows_per_program, BLOCK: tl.constexpr, HAS_DS_IN: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            dxhat = dy * w
            dw += dy * xhat
            dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, 0) / n_cols))
            if HAS_DS_IN:
                dx += tl.load(DS_IN + row * stride_dsin + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + cols, to_dtype(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _launch_shape(n_rows: int, x: torch.Tensor, persistent: bool) -> tuple[int, int]:
    """(rows per program, programs). Interpreter: 4 programs. GPU forward: one row per program; GPU
    backward (persistent): about 4 programs per SM, which bounds the fp32 partial-dw buffer."""
    if x.device.type == "cpu":
        programs = 4
    elif not persistent:
        return 1, n_rows
    else:
        programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = max(1, triton.cdiv(n_rows, programs))
    return rows, triton.cdiv(n_rows, rows)


def rms_norm_fwd(x2d, residual2d, weight, eps: float):
    n_rows, n_cols = x2d.shape
    y = torch.empty_like(x2d)
    summed = torch.empty_like(x2d) if residual2d is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return y, summed, rstd
    block = row_block(n_cols)
    rows, programs = _launch_shape(n_rows, x2d, persistent=False)
    r = residual2d if residual2d is not None else x2d
    s = summed if summed is not None else y
    _rms_norm_fwd_kernel[(programs,)](
        x2d, r, weight, y, s, rstd, n_rows, n_cols, x2d.stride(0), r.stride(0), y.stride(0), s.stride(0), eps,
        rows, BLOCK=block, HAS_RESIDUAL=residual2d is not None, num_warps=num_warps_for(block),
    )
    return y, summed, rstd


def rms_norm_bwd(dy, dsummed, x_normed, weight, rstd):
    n_rows, n_cols = x_normed.shape
    dx = torch.empty_like(x_normed)
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block = row_block(n_cols)
    rows, programs = _launch_shape(n_rows, x_normed, persistent=True)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x_normed.device)
    ds_in = dsummed if dsummed is not None else dy
    _rms_norm_bwd_kernel[(programs,)](
        dy, ds_in, x_normed, weight, rstd, dx, dw_partial, n_rows, n_cols,
        dy.stride(0), ds_in.stride(0), x_normed.stride(0), dx.stride(0),
        rows, BLOCK=block, HAS_DS_IN=dsummed is not None, num_warps=num_warps_for(block),
    )
    return dx, dw_partial.sum(0).to(weight.dtype)


@torch.library.custom_op("megatron_vlm::triton_rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = rms_norm_fwd(x, None, weight, eps)
    return y, rstd


@rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("megatron_vlm::triton_rms_norm_residual_fwd", mutates_args=())
def rms_norm_residual_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, summed, rstd = rms_norm_fwd(x, residual, weight, eps)
    return y, summed, rstd


@rms_norm_residual_fwd_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("megatron_vlm::triton_rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(
    dy: torch.Tensor, dsummed: Optional[torch.Tensor], x_normed: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_bwd(dy.contiguous(), None if dsummed is None else dsummed.contiguous(), x_normed, weight, rstd)


@rms_norm_bwd_op.register_fake
def _(dy, dsummed, x_normed, weight, rstd):
    return torch.empty_like(x_normed), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(dy, None, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd_op.register_autograd(_backward, setup_context=_setup)


def _setup_residual(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, summed, rstd = output
    ctx.save_for_backward(summed, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward_residual(ctx, dy, dsummed, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(summed)
    ds, dw = rms_norm_bwd_op(dy, dsummed, summed, weight, rstd)
    return ds, ds, dw, None


rms_norm_residual_fwd_op.register_autograd(_backward_residual, setup_context=_setup_residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Public-signature RMSNorm on the Triton kernels."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_device("rms_norm", x)
    shape = x.shape
    x2d = x.reshape(-1, shape[-1]).contiguous()
    direct = direct_launch(x, weight, residual)  # inference: no custom-op dispatch (common.direct_launch)
    if residual is None:
        if direct:
            y, _, _ = rms_norm_fwd(x2d, None, weight.contiguous(), float(eps))
        else:
            y, _ = rms_norm_fwd_op(x2d, weight.contiguous(), float(eps))
        return y.reshape(shape)
    r2d = residual.to(x.dtype).reshape(-1, shape[-1]).contiguous()
    if direct:
        y, summed, _ = rms_norm_fwd(x2d, r2d, weight.contiguous(), float(eps))
    else:
        y, summed, _ = rms_norm_residual_fwd_op(x2d, r2d, weight.contiguous(), float(eps))
    return y.reshape(shape), summed.reshape(shape)
