"""Triton AdamW step with bf16 moments: one fused pass per parameter tensor (the contract, and why bf16
moments are rounded stochastically, are in kernels/reference/adamw.py).

Each element is read once (parameter, gradient, both moments) and written once (parameter, both
moments): 20 bytes per fp32 parameter against 28 for fp32 moments, so the step is also less memory
traffic than torch's fused fp32 AdamW. The two roundings draw 16 bits each from one Philox number of
the element's offset (seeded per tensor), so a call is deterministic for a given seed. One launch per
tensor (with a local offset below 2^31: the random offset is 32-bit); an empty tensor launches nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.adamw import adamw_bf16_moments as reference
from ..reference.adamw import check_keys, tensor_seed
from .common import check_device, to_dtype


@triton.jit
def _round_bf16(x, rand16):
    """fp32 -> bf16, stochastically: the random low bits carry into the kept ones; a NaN stays one (reference: same
    rule, and why)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, (bits + rand16) & -65536)
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _adamw_bf16_moments_kernel(PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, n, decay, step_size, beta1, beta2, inv_sqrt_bc2,
                               eps, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: the last block's lanes past n
    mask = offs < n  # stay past it (an int32 offset near 2^31 would wrap negative and pass this mask)
    local = offs.to(tl.int32)  # the random stream's offset (n < 2^31: exact where stored)
    p = tl.load(PARAM + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(EXP_AVG + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(EXP_AVG_SQ + offs, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p * decay - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(PARAM + offs, to_dtype(p, PARAM.dtype.element_ty), mask=mask)
    r = tl.randint(seed, local).to(tl.int32, bitcast=True)
    tl.store(EXP_AVG + offs, _round_bf16(m, r & 0xFFFF), mask=mask)
    tl.store(EXP_AVG_SQ + offs, _round_bf16(v, (r >> 16) & 0xFFFF), mask=mask)


def _block(t: torch.Tensor) -> int:
    return 4096 if t.device.type == "cpu" else 1024


@torch.no_grad()
def adamw_bf16_moments(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, seed: int, keys: Optional[Sequence[int]] = None) -> None:
    """Same contract as the reference (kernels/reference/adamw.py); tensors of < 2^31 elements; a non-contiguous one
    goes through the reference (its rounding draws other random bits)."""
    if not params:
        return
    keys = check_keys(keys, len(params))
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    decay, step_size, inv_sqrt_bc2 = 1.0 - lr * weight_decay, lr / bc1, 1.0 / bc2 ** 0.5
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        n = p.numel()
        if n == 0:
            continue
        if m.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            raise TypeError(f"adamw_bf16_moments: moments must be bf16, got {m.dtype} / {v.dtype}")
        if any(t.numel() != n for t in (g, m, v)):
            raise ValueError("adamw_bf16_moments (triton): tensors of equal sizes only")
        if not all(t.is_contiguous() for t in (p, g, m, v)):  # none met so far (FSDP2 / TP shards are contiguous)
            reference(*([t] for t in (p, g, m, v)), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                      step=step, seed=seed, keys=[keys[i]])
            continue
        if n >= 1 << 31:
            raise ValueError(f"adamw_bf16_moments (triton): a tensor of {n} elements (at most 2^31 - 1)")
        check_device("adamw_bf16_moments", p, g, m, v)
        block = _block(p)
        _adamw_bf16_moments_kernel[(triton.cdiv(n, block),)](
            p, g, m, v, n, decay, step_size, beta1, beta2, inv_sqrt_bc2, eps, tensor_seed(seed, keys[i]),
            BLOCK=block, num_warps=4)
