"""`linear_token_logprobs` on Liger-Kernel's fused linear cross-entropy (linkedin/Liger-Kernel), with and
without gradients (with them only on liger-kernel >= 0.8.5, see below).

Forceable only (`[kernels] <op> = "liger"`), never chosen by `auto`, decided from the benchmarks: on an
NVIDIA H100 (2026-11-26, torch 2.11, triton 3.6, liger-kernel 0.8.5; one run per case, benchmarks/RESULTS.md
"Second GPU run") none of Liger's ops beat ours:
- linear_token_logprobs without gradients (benchmarks/kernels/bench_liger.py, N 16k): 20.3 / 30.1 / 20.1 ms
  vs our Triton kernel's 19.7 / 31.3 / 21.3 ms at the 3B / 7B / Nemotron vocabularies, a tie within noise;
- swiglu (bench_swiglu.py): 93-99 % of copy bandwidth forward, 83-97 % backward; ours 98-100 % / 99 %;
- rms_norm forward (bench_rms_norm.py): 86-93 %; ours 88-96 % (its backward row is not measured yet);
- rotary (liger_rope, bench_rotary.py, q and k together): 80-83 % forward, 29-31 % backward; ours 94-95 %
  and 56-95 %.

Liger's `liger_fused_linear_cross_entropy(input, weight, target, ..., ignore_index, reduction="none")`
returns -log p per token (0 at ignored labels, as our contract). What the adapter does about the rest
of our contract (kernels/reference/token_logprobs.py), each fallback to the reference logged once:

- temperature: Liger has none -> the hidden states are divided by it (z = (h / T) W^T = (h W^T) / T);
- entropy: not computed there -> `return_entropy=True` runs the reference;
- gradients: Liger computes its input / weight gradients during the forward; older releases scaled them in
  the backward by the incoming gradient as one scalar, which is wrong for per-token weights (GRPO
  advantages, masks). 0.8.5 applies a per-token incoming gradient correctly with reduction "none" (checked
  in tests/unit/kernels/test_thirdparty_liger.py through Triton's interpreter) -> graded calls run Liger
  from 0.8.5 and the reference before it (logged); without gradients the inputs are detached, so Liger
  skips computing them;
- `chunk_size` is ignored (Liger sizes its chunks itself).

`rms_norm` and `swiglu` (forceable only, CUDA only: Liger's norm / SwiGLU kernels do not run in the
Triton interpreter; on an H200 (2026-11-25) and an H100 (2026-11-26) both matched our references in bf16,
tests/gpu/test_gpu_thirdparty_liger.py):

- `rms_norm` -> `liger_rms_norm(x, w, eps, offset=0, casting_mode="gemma", in_place=False)`: the "gemma"
  casting mode computes in fp32 and casts at the end, as our contract does (Liger's default "llama" mode
  casts to x's dtype before the weight, which differs in bf16); with a residual,
  `liger_fused_add_rms_norm(x, residual, w, eps, casting_mode="gemma")` returns (normed, x + residual),
  the sum rounded to x's dtype as in our contract. Shape errors are the reference's.
- `swiglu` -> `liger_swiglu(gate, up)` (silu in fp32, the product in the input dtype: bf16 results may
  differ from the reference in the last bit).
- `apply_rotary` is not mapped: `liger_rope(q, k, cos, sin)` rotates q and k together in the [B, H, S, D]
  layout with non-interleaved halves over the full head dim; our op rotates one token-major tensor with
  optional interleaving and a partial `rotary_dim`.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..reference import token_logprobs as reference

logger = logging.getLogger("megatron_vlm.kernels")
_logged: set = set()


def _fallback(reason: str):
    if reason not in _logged:
        _logged.add(reason)
        logger.info("linear_token_logprobs: backend liger falls back to the torch reference: %s", reason)
    return reference.linear_token_logprobs


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
):
    """Public-signature fused LM head + token log-probs on Liger (contract: the reference)."""
    kwargs = dict(temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size)
    if return_entropy:
        return _fallback("entropy (Liger's fused linear cross-entropy returns the loss only)")(hidden, weight, labels, **kwargs)
    graded = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if graded and not _per_token_backward():
        return _fallback("gradients (liger-kernel < 0.8.5 applies the incoming gradient as one scalar, so per-token "
                         "weights would be wrong)")(hidden, weight, labels, **kwargs)
    reference.check_token_logprobs_inputs(hidden, weight, labels, temperature)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h, w = (hidden, weight) if graded else (hidden.detach(), weight.detach())
    if temperature != 1.0:
        h = h / temperature
    loss = liger_fused_linear_cross_entropy(h, w, labels, ignore_index=reference.IGNORE_INDEX, reduction="none")
    return -loss.float()


def _per_token_backward() -> bool:
    """Whether the installed liger-kernel scales its precomputed gradients per token (0.8.5 and later)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("liger-kernel").split(".")[:3]
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts) >= (0, 8, 5)
    except PackageNotFoundError:
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None):
    """Public-signature rms_norm on Liger's RMSNorm, fp32 "gemma" casting (contract: kernels/reference/norms.py)."""
    from ..reference.norms import rms_norm as reference_rms_norm

    if weight.shape != (x.shape[-1],) or (residual is not None and residual.shape != x.shape):
        return reference_rms_norm(x, weight, eps, residual=residual)  # raises the reference's shape error
    from liger_kernel.transformers.functional import liger_fused_add_rms_norm, liger_rms_norm

    if residual is None:
        return liger_rms_norm(x.contiguous(), weight, eps, offset=0.0, casting_mode="gemma", in_place=False)
    out, summed = liger_fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps, offset=0.0,
                                             casting_mode="gemma", in_place=False)
    return out, summed


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Public-signature swiglu on Liger's SiLU-mul (contract: kernels/reference/swiglu.py)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    from liger_kernel.transformers.functional import liger_swiglu

    return liger_swiglu(gate.contiguous(), up.contiguous())
