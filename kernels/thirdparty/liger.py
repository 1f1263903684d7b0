"""`linear_token_logprobs` on Liger-Kernel's fused linear cross-entropy (linkedin/Liger-Kernel), for the
forwards without gradients: reference and old-policy log-probs, behaviour checks, evaluation.

Forceable only (`[kernels] linear_token_logprobs = "liger"`), never chosen by `auto`: nothing here has
measured it against our chunked op or our Triton kernel on a GPU (benchmarks/kernels/bench_liger.py
holds the row that decides), so it stays opt-in until a measurement says it is faster.

Liger's `liger_fused_linear_cross_entropy(input, weight, target, ..., ignore_index, reduction="none")`
returns -log p per token (0 at ignored labels, as our contract). What the adapter does about the rest
of our contract (kernels/reference/token_logprobs.py), each fallback to the reference logged once:

- temperature: Liger has none -> the hidden states are divided by it (z = (h / T) W^T = (h W^T) / T);
- entropy: not computed there -> `return_entropy=True` runs the reference;
- gradients: Liger computes its input / weight gradients during the forward and its backward scales them
  by the incoming gradient as one scalar, so per-token loss weights (GRPO advantages, masks) would be
  applied wrongly -> a call that records gradients runs the reference; without gradients the inputs are
  detached, so Liger skips computing them;
- `chunk_size` is ignored (Liger sizes its chunks itself).
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
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _fallback("gradients (Liger's backward applies the incoming gradient as one scalar, so per-token "
                         "weights would be wrong)")(hidden, weight, labels, **kwargs)
    reference.check_token_logprobs_inputs(hidden, weight, labels, temperature)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.detach()
    if temperature != 1.0:
        h = h / temperature
    loss = liger_fused_linear_cross_entropy(h, weight.detach(), labels, ignore_index=reference.IGNORE_INDEX,
                                            reduction="none")
    return -loss.float()
