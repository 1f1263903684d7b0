"""AdamW step with bf16 moments over fp32 (master) parameters: the reference, in torch ops on any device.

Why bf16 moments: AdamW's two moments in fp32 are 8 bytes per trainable parameter, as much as the fp32
master weights and their gradients together; in bf16 they are 4. At the Qwen2.5-VL-3B shape on one GPU
that is 14 GiB, the difference between a 16k-token step with selective activation checkpointing
fitting an 80 GB card or not (DeepSeek-V3 trained with bf16 moments; Megatron-LM's precision-aware
optimizer offers them).

Why stochastic rounding: the update v <- b2 v + (1 - b2) g^2 with the usual b2 = 0.999 changes v by
0.1 % a step, below half a bf16 ulp (0.39 %): rounded to nearest, b2 v rounds back to v and the
second moment never decays (nor grows by small g^2). Rounding up with probability equal to the
discarded fraction keeps each stored moment an unbiased estimate of its fp32 value. The update itself
uses the fp32 moments of this step before rounding.

Contract (the Triton kernel, kernels/triton/adamw.py, implements the same): lists of plain tensors of
equal shapes per index, updated in place; `params` fp32 (or bf16 / fp16: computed in fp32, stored in
their dtype), `grads` any float dtype, `exp_avgs` / `exp_avg_sqs` bf16; `step` is the step number
after its increment (1 on the first update); `seed` makes the rounding deterministic: tensor i of the
call draws from seed `tensor_seed(seed, keys[i])`, `keys` defaulting to the positions 0, 1, ... (a caller passes
keys of its own so that two copies of one weight, e.g. a tied embedding on two pipeline stages, round alike
wherever they sit in their lists).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

CHUNK = 1 << 22
"""Elements per piece of a large tensor: bounds the fp32 temporaries (~5 x 16 MiB) of the reference."""


NAN_BITS = 0x7FC00000
"""The quiet fp32 NaN, exact in bf16: what a NaN moment is stored as."""


def tensor_seed(seed: int, key: int) -> int:
    """The rounding seed of the tensor of key `key` in a call (31 bits; distinct for keys distinct modulo 2^31)."""
    return (int(seed) + int(key) * 0x9E3779B1) & 0x7FFFFFFF


def check_keys(keys: Optional[Sequence[int]], n: int) -> Sequence[int]:
    """The tensors' rounding keys (`keys`, one per tensor; None: their positions)."""
    if keys is None:
        return range(n)
    if len(keys) != n:
        raise ValueError(f"adamw_bf16_moments: {len(keys)} keys for {n} tensors")
    return keys


def round_bf16_stochastic(x: torch.Tensor, rand16: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to bf16, rounded away from zero with probability (discarded low 16 bits) / 2^16, given
    `rand16`: int32 uniform in [0, 2^16) of x's shape. Adding the random bits to the fp32 pattern carries into
    the kept bits exactly in that case; the carry propagates into the exponent as rounding should. A NaN is kept a
    NaN (the quiet one): added to, CUDA's canonical NaN 0x7FFFFFFF would carry into the sign bit (-0.0), and one with
    only low mantissa bits set would truncate to inf."""
    x = x.contiguous()
    bits = torch.where(x.isnan(), NAN_BITS, (x.view(torch.int32) + rand16) & -65536)
    return bits.view(torch.float32).to(torch.bfloat16)


def _update(p, g, m, v, *, decay, step_size, beta1, beta2, inv_sqrt_bc2, eps, gen) -> None:
    g32 = g.float()
    m32 = m.float().mul_(beta1).add_(g32, alpha=1.0 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
    denom = v32.sqrt().mul_(inv_sqrt_bc2).add_(eps)
    p32 = p.float().mul_(decay).addcdiv_(m32, denom, value=-step_size)
    p.copy_(p32)
    rand = torch.randint(0, 1 << 16, (2, *m32.shape), dtype=torch.int32, device=m32.device, generator=gen)
    m.copy_(round_bf16_stochastic(m32, rand[0]))
    v.copy_(round_bf16_stochastic(v32, rand[1]))


@torch.no_grad()
def adamw_bf16_moments(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, seed: int, keys: Optional[Sequence[int]] = None) -> None:
    """One AdamW update (torch.optim.AdamW's: decoupled weight decay p *= 1 - lr wd, bias-corrected moments)
    of every tensor, in place; the moments stored in bf16 with stochastic rounding (module docstring)."""
    if not params:
        return
    keys = check_keys(keys, len(params))
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    kw = dict(decay=1.0 - lr * weight_decay, step_size=lr / bc1, beta1=beta1, beta2=beta2,
              inv_sqrt_bc2=1.0 / bc2 ** 0.5, eps=eps)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if m.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            raise TypeError(f"adamw_bf16_moments: moments must be bf16, got {m.dtype} / {v.dtype}")
        if p.numel() == 0:
            continue
        gen = torch.Generator(device=p.device).manual_seed(tensor_seed(seed, keys[i]))
        if not all(t.is_contiguous() for t in (p, g, m, v)):
            _update(p, g, m, v, gen=gen, **kw)
            continue
        flat = [t.view(-1) for t in (p, g, m, v)]
        for s in range(0, p.numel(), CHUNK):
            _update(*(t[s:s + CHUNK] for t in flat), gen=gen, **kw)
