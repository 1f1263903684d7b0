"""`linear_token_logprobs` with the per-row algebra in C++ (csrc/cpu_token_logprobs.cpp): the CPU csrc backend.

Why: the reference (kernels/reference/token_logprobs.py) runs each chunk's log-sum-exp, label gather, softmax
and entropy (forward) and its gradient algebra (backward) as ~6 and ~10 ATen passes over the [chunk, V]
logits; here each is one C++ pass per row, the backward's written over the recomputed logits. The GEMMs, the
chunking, the saved tensors (hidden, weight, labels, per-row log-sum-exp and entropy) and the contract are
the reference's: same signature, outputs and errors; values equal to fp32 rounding
(tests/unit/csrc/test_csrc_token_logprobs.py). float32 only (other dtypes run the reference).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..reference.token_logprobs import check_token_logprobs_inputs, label_mask, resolve_chunk_size
from ..reference.token_logprobs import linear_token_logprobs as _ref_linear_token_logprobs
from .layer_ops import _fits, _ops

__all__ = ["linear_token_logprobs"]

KEEP_LOGITS_BYTES = 64 * 2**20
"""When the fp32 logits of all rows take at most this, the forward keeps them for the backward instead of
recomputing them there: one [N, H] x [H, V] GEMM less per call (~1/4 of the head's backward work) for
small vocabularies or few tokens. Above it (any real vocabulary at training lengths: 16k tokens x 152k
is ~10 GB) the backward recomputes chunk by chunk, which is what keeps the memory at one chunk."""


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, with_entropy, keep):
        n, vocab = hidden.shape[0], weight.shape[0]
        safe, valid = label_mask(labels, vocab)
        parts, kept = [], []
        for s in range(0, n, chunk_size):
            z = torch.matmul(hidden[s:s + chunk_size], weight.t())
            if temperature != 1.0:
                z.div_(temperature)
            parts.append(_ops().token_logprob_rows(z, safe[s:s + chunk_size], with_entropy))
            if keep:
                kept.append(z)
        if parts:
            logp, lse, ent = (torch.cat(t) for t in zip(*parts))
        else:
            logp = lse = ent = hidden.new_zeros(0, dtype=torch.float32)
        logp = torch.where(valid, logp, 0.0)
        ent = torch.where(valid, ent, 0.0)
        ctx.save_for_backward(hidden, weight, safe, valid, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.kept = kept or None  # the backward overwrites them with the gradient: used once (see backward)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, safe, valid, lse, ent = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logp = torch.zeros_like(lse) if grad_logp is None else (grad_logp.float() * valid).contiguous()
        grad_ent = (grad_ent.float() * valid).contiguous() if ctx.with_entropy and grad_ent is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes: these become gradients
        for i, s in enumerate(range(0, hidden.shape[0], c)):
            h = hidden[s:s + c]
            if kept is not None:
                g = kept[i]
            else:
                g = torch.matmul(h, weight.t())
                if t != 1.0:
                    g.div_(t)
            _ops().token_logprob_grad_rows(g, safe[s:s + c], lse[s:s + c], ent[s:s + c], grad_logp[s:s + c],
                                           None if grad_ent is None else grad_ent[s:s + c], 1.0 / t)
            if need_h:
                torch.matmul(g, weight, out=grad_h[s:s + c])
            if need_w:
                grad_w.addmm_(g.t(), h)
        return grad_h, grad_w, None, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """log p(labels) [N] fp32 (and entropy [N] fp32) of softmax(hidden @ weight^T / temperature), chunked."""
    if not _fits(hidden, weight) or hidden.dim() != 2 or not hidden.is_contiguous():
        return _ref_linear_token_logprobs(hidden, weight, labels, temperature=temperature,
                                          return_entropy=return_entropy, chunk_size=chunk_size)
    check_token_logprobs_inputs(hidden, weight, labels, temperature)
    chunk = resolve_chunk_size(hidden, weight, chunk_size)
    # keep the logits for the backward only when there will be one (not under no_grad) and they are small
    keep = (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            and hidden.shape[0] * weight.shape[0] * 4 <= KEEP_LOGITS_BYTES)
    logp, ent = _LinearTokenLogprobs.apply(hidden, weight, labels, float(temperature), chunk, bool(return_entropy), keep)
    return (logp, ent) if return_entropy else logp
