"""Ascend adapter for `apply_rotary` on `torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode)`.

npu_rotary_mul computes input * r1 + rotate(input) * r2 with rotate = rotate_half ("half") or the
interleaved pair rotation ("interleave") on 4-D inputs; for the BSND layout r1 / r2 may be
1S1D, BS1D or BSND. Our x `[..., T, H, D]` is viewed as BSND (leading dims folded into B, a
packed `[T, H, D]` gets B = 1) and the full-width cos / sin as BS1D. Partial rotary rotates
x[..., :D_rot] and concatenates the untouched tail. cos / sin are cast to x's dtype (the op
takes one dtype).
"""
from typing import Optional

import torch

from ..reference.rotary import expand_cos_sin
from ._torch_npu import torch_npu_module


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, rotary_dim: Optional[int] = None
) -> torch.Tensor:
    """Public-signature rotary embedding on torch_npu (contract: kernels/reference/rotary.py)."""
    torch_npu = torch_npu_module("apply_rotary")
    cos, sin = expand_cos_sin(x, cos, sin, interleaved, rotary_dim)  # [..., T, 1, D_rot]
    shape = x.shape
    t, d_rot = shape[-3], cos.shape[-1]
    x4 = x.reshape(-1, t, shape[-2], shape[-1])
    if all(n == 1 for n in cos.shape[:-3]):  # shared over the batch: the 1S1D layout, no copy
        r1, r2 = cos.reshape(1, t, 1, d_rot), sin.reshape(1, t, 1, d_rot)
    else:  # per-sample angles (M-RoPE): BS1D
        r1 = cos.expand(*shape[:-2], 1, d_rot).reshape(-1, t, 1, d_rot)
        r2 = sin.expand(*shape[:-2], 1, d_rot).reshape(-1, t, 1, d_rot)
    r1, r2 = r1.to(x.dtype), r2.to(x.dtype)
    mode = "interleave" if interleaved else "half"
    rotated = torch_npu.npu_rotary_mul(x4[..., :d_rot].contiguous(), r1, r2, rotary_mode=mode)
    if d_rot < shape[-1]:
        rotated = torch.cat([rotated, x4[..., d_rot:]], dim=-1)
    return rotated.reshape(shape)
