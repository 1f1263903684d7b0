"""Triton rotary embedding with per-token cos / sin (forward + backward).

Every feature i < D_rot of every head is out[i] = x[i] * cos[i] + sign(i) * x[p(i)] * sin[i], with
the partner p(i) = i +- D_rot/2 and sign -1 on the first half (rotate_half, GPT-NeoX / Qwen), or
p(i) = i ^ 1 with sign -1 on even i (interleaved, GPT-J). Features >= D_rot pass through. The map
is linear in x, and its transpose gives the backward:
  dx[j] = dy[j] * cos[j] - sign(j) * dy[p(j)] * sin[p(j)],
so one shared body serves both kernels with a flag. cos / sin arrive full width (the reference's
`expand_cos_sin` turns the accepted layouts into `[..., T, 1, D_rot]`) and are indexed per
(batch, token) through strides, so broadcasting over the batch costs no copy.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.rotary import expand_cos_sin
from .common import check_device, direct_launch, to_dtype


@triton.jit
def _rotary_body(
    X, COS, SIN, Y, n_tokens, n_heads, stride_xr, stride_xh, stride_cb, stride_ct, stride_yr, stride_yh,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
):
    row = tl.program_id(0)  # flattened (batch, token)
    hb = tl.program_id(1)
    bi = row // n_tokens
    ti = row % n_tokens
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h = heads < n_heads
    mask_d = d < HEAD_DIM
    rot = d < ROT_DIM
    if INTERLEAVED:
        partner = d ^ 1
        sign = tl.where((d % 2) == 0, -1.0, 1.0)
    else:
        half = ROT_DIM // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
    c_base = COS + bi * stride_cb + ti * stride_ct
    s_base = SIN + bi * stride_cb + ti * stride_ct
    cos = tl.load(c_base + d, mask=rot, other=1.0).to(tl.float32)
    if BACKWARD:
        sin_p = tl.load(s_base + partner, mask=rot, other=0.0).to(tl.float32)
        coef = -sign * sin_p
    else:
        sin = tl.load(s_base + d, mask=rot, other=0.0).to(tl.float32)
        coef = sign * sin
    base = X + row * stride_xr + heads[:, None] * stride_xh
    m2 = mask_h[:, None] & mask_d[None, :]
    x = tl.load(base + d[None, :], mask=m2, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask_h[:, None] & rot[None, :], other=0.0).to(tl.float32)
    y = x * cos[None, :] + xp * coef[None, :]
    tl.store(Y + row * stride_yr + heads[:, None] * stride_yh + d[None, :], to_dtype(y, Y.dtype.element_ty), mask=m2)


@triton.jit
def _rotary_fwd_kernel(
    X, COS, SIN, Y, n_tokens, n_heads, stride_xr, stride_xh, stride_cb, stride_ct, stride_yr, stride_yh,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    _rotary_body(X, COS, SIN, Y, n_tokens, n_heads, stride_xr, stride_xh, stride_cb, stride_ct, stride_yr, stride_yh,
                 HEAD_DIM, ROT_DIM, BLOCK_H, BLOCK_D, INTERLEAVED, False)


@triton.jit
def _rotary_bwd_kernel(
    DY, COS, SIN, DX, n_tokens, n_heads, stride_xr, stride_xh, stride_cb, stride_ct, stride_yr, stride_yh,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    _rotary_body(DY, COS, SIN, DX, n_tokens, n_heads, stride_xr, stride_xh, stride_cb, stride_ct, stride_yr, stride_yh,
                 HEAD_DIM, ROT_DIM, BLOCK_H, BLOCK_D, INTERLEAVED, True)


def _launch(kernel, x3, cos3, sin3, n_tokens: int, interleaved: bool) -> torch.Tensor:
    """x3 [R, H, D] (any row / head strides, last stride 1), cos3 / sin3 [B, T, D_rot] (any strides, last stride 1),
    R = B * T; the output is contiguous."""
    rows, heads, d = x3.shape
    # not empty_like: it keeps a dense x3's permuted strides (heads before rows), and the output is contiguous
    y = torch.empty(x3.shape, dtype=x3.dtype, device=x3.device)
    if rows == 0 or heads == 0:
        return y
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
    kernel[(rows, triton.cdiv(heads, block_h))](
        x3, cos3, sin3, y, n_tokens, heads, x3.stride(0), x3.stride(1), cos3.stride(0), cos3.stride(1),
        y.stride(0), y.stride(1),
        HEAD_DIM=d, ROT_DIM=cos3.shape[-1], BLOCK_H=block_h, BLOCK_D=block_d, INTERLEAVED=interleaved,
        num_warps=4,
    )
    return y


@torch.library.custom_op("megatron_vlm::triton_rotary", mutates_args=())
def rotary_op(x3: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _launch(_rotary_fwd_kernel, x3, cos3, sin3, cos3.shape[1], interleaved)


@rotary_op.register_fake
def _(x3, cos3, sin3, interleaved):
    return torch.empty_like(x3)


@torch.library.custom_op("megatron_vlm::triton_rotary_bwd", mutates_args=())
def rotary_bwd_op(dy3: torch.Tensor, cos3: torch.Tensor, sin3: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _launch(_rotary_bwd_kernel, dy3.contiguous(), cos3, sin3, cos3.shape[1], interleaved)


@rotary_bwd_op.register_fake
def _(dy3, cos3, sin3, interleaved):
    return torch.empty_like(dy3)


def _setup(ctx, inputs, output):
    _, cos3, sin3, interleaved = inputs
    ctx.save_for_backward(cos3, sin3)
    ctx.interleaved = interleaved


def _backward(ctx, dy):
    cos3, sin3 = ctx.saved_tensors
    return rotary_bwd_op(dy, cos3, sin3, ctx.interleaved), None, None, None


rotary_op.register_autograd(_backward, setup_context=_setup)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, rotary_dim: Optional[int] = None
) -> torch.Tensor:
    """Public-signature rotary embedding on the Triton kernels (contract: kernels/reference/rotary.py)."""
    cos, sin = expand_cos_sin(x, cos, sin, interleaved, rotary_dim)  # [..., T, 1, D_rot]
    check_device("apply_rotary", x)
    shape = x.shape
    n_tokens, heads, d = shape[-3], shape[-2], shape[-1]
    lead = shape[:-3]
    batch = 1
    for s in lead:
        batch *= s
    d_rot = cos.shape[-1]
    # Broadcast cos / sin to x's [lead..., T, D_rot] without copying, then fold lead into one dim.
    cos3 = cos.squeeze(-2).expand(*lead, n_tokens, d_rot).reshape(batch, n_tokens, d_rot)
    sin3 = sin.squeeze(-2).expand(*lead, n_tokens, d_rot).reshape(batch, n_tokens, d_rot)
    if cos3.stride(-1) != 1:
        cos3, sin3 = cos3.contiguous(), sin3.contiguous()
    if sin3.stride() != cos3.stride():
        cos3, sin3 = cos3.contiguous(), sin3.contiguous()
    x3 = x.reshape(batch * n_tokens, heads, d)
    if direct_launch(x, cos, sin):  # inference: no custom-op dispatch (common.direct_launch)
        # rows and heads are read through their strides: a row-strided x (the q and k heads of a fused q / k / v
        # projection's output, models/common/fused_projections.py) is rotated in place of a copy
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
        return _launch(_rotary_fwd_kernel, x3, cos3, sin3, cos3.shape[1], bool(interleaved)).reshape(shape)
    return rotary_op(x3.contiguous(), cos3, sin3, bool(interleaved)).reshape(shape)
