"""`linear_token_logprobs`, `rms_norm` and `swiglu` on Liger-Kernel (linkedin/Liger-Kernel, Triton),
forceable through `[kernels]` only (experimental: not yet run on a GPU).

Why no `auto`: Liger is registered to win `auto` only where a measurement says it beats our Triton
kernels, and none has been taken yet (no GPU; Liger 0.8 does not even import on a CPU-only Triton).
`benchmarks/kernels/bench_liger.py` prints the rows that decide it on the next machine with a GPU.

Mapping onto Liger's documented functional interface (`liger_kernel.transformers.functional`):

- `linear_token_logprobs` -> `liger_fused_linear_cross_entropy(input, weight, target,
  ignore_index=-100, reduction="none", accum_dtype=float32)`: with reduction "none" it returns the
  fp32 per-token loss -log p (0 at ignore_index), so log p = -loss. Liger has no temperature: hidden is
  divided by it first ((h / T) W^T = h W^T / T). Labels are cast to int64 and checked against [0, V)
  as the reference does. Liger returns no entropy -> calls with `return_entropy=True` run the
  reference (logged once). `chunk_size` is ours (a memory knob); Liger chunks by itself.
- `rms_norm` -> `liger_rms_norm(x, w, eps, offset=0, casting_mode="gemma", in_place=False)`: the
  "gemma" casting mode computes everything in fp32 and casts at the end, as our contract does (the
  default "llama" mode casts to x's dtype before the weight). With a residual,
  `liger_fused_add_rms_norm(x, residual, w, eps, casting_mode="gemma")` returns (normed, x + residual).
  Only a last-dim weight of hidden size, contiguous rows.
- `swiglu` -> `liger_swiglu(gate, up)` (silu(gate) * up, same shapes).
- `apply_rotary` is NOT mapped: `liger_rope(q, k, cos, sin)` rotates q and k together in the
  [B, H, S, D] layout with non-interleaved halves over the full head dim, while our op rotates one
  tensor (token-major, optional interleaving and partial `rotary_dim`); the translation would cost
  more than the kernel saves.
Liger needs CUDA tensors of dtype fp32 / fp16 / bf16 (the registry's check).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..reference import token_logprobs as reference_logprobs
from ..reference.norms import rms_norm as reference_rms_norm

logger = logging.getLogger("megatron_vlm.kernels")
_logged: set = set()


def _fallback_reason(op: str, reason: str) -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.info("%s: backend liger falls back to the torch reference: %s", op, reason)


def _functional():
    from liger_kernel.transformers import functional

    if "start" not in _logged:
        _logged.add("start")
        logger.info("kernels: Liger-Kernel backend in use (experimental: not yet run on a GPU)")

    return functional


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
):
    """Public-signature linear_token_logprobs on Liger's fused linear cross-entropy (contract: the reference)."""
    if return_entropy:
        _fallback_reason("linear_token_logprobs", "entropy requested (Liger's fused linear cross-entropy returns none)")
        return reference_logprobs.linear_token_logprobs(hidden, weight, labels, temperature=temperature,
                                                        return_entropy=True, chunk_size=chunk_size)
    reference_logprobs.check_token_logprobs_inputs(hidden, weight, labels, temperature)
    ignore = reference_logprobs.IGNORE_INDEX
    vocab = weight.shape[0]
    bad = ((labels < 0) & (labels != ignore)) | (labels >= vocab)
    if bool(bad.any()):
        raise ValueError(f"linear_token_logprobs: label {labels[bad][0].item()} outside [0, {vocab}) and not {ignore}")
    scaled = hidden if temperature == 1.0 else hidden / temperature
    loss = _functional().liger_fused_linear_cross_entropy(
        scaled, weight, labels.long(), ignore_index=ignore, reduction="none", accum_dtype=torch.float32,
    )
    return -loss.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None):
    """Public-signature rms_norm on Liger's RMSNorm (fp32 "gemma" casting; contract: the reference)."""
    if weight.shape != (x.shape[-1],) or (residual is not None and residual.shape != x.shape):
        return reference_rms_norm(x, weight, eps, residual=residual)  # raises the reference's shape error
    f = _functional()
    if residual is None:
        return f.liger_rms_norm(x.contiguous(), weight, eps, offset=0.0, casting_mode="gemma", in_place=False)
    out, summed = f.liger_fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps, offset=0.0,
                                             casting_mode="gemma", in_place=False)
    return out, summed


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Public-signature swiglu on Liger's SiLU-mul (contract: the reference)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return _functional().liger_swiglu(gate.contiguous(), up.contiguous())
