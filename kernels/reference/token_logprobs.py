"""Reference fused linear + token log-probabilities (and entropy), chunked over tokens.

log p(label_n) = z[n, label_n] - logsumexp(z[n]) with z = (hidden @ weight^T) / temperature, the
quantity GRPO needs for policy, reference and behaviour models. The naive path materialises
[N, V] logits (V = 151936 for Qwen) plus their log_softmax; here rows are processed in chunks of
`chunk_size` tokens inside a custom autograd.Function that keeps only hidden / weight / labels and
the per-row logsumexp (and entropy) for backward and recomputes each chunk's logits there, so the
extra memory is one [chunk, V] fp32 block.

Entropy H_n = -sum_v p log p of softmax(z[n]). Gradients (per row, w.r.t. z):
  d logp / dz_v = onehot(label)_v - p_v ;  dH / dz_v = -p_v (log p_v + H).
Labels equal to `ignore_index` (-100) give log-prob 0 and entropy 0 and receive no gradient.
Matmuls run in the input dtype with the result upcast to fp32 (CPU) — the softmax, log and
gradient algebra are fp32; outputs are fp32 (log-probs feed losses; keep them precise).
"""
from typing import Optional, Union

import torch

IGNORE_INDEX = -100


def default_chunk_size(num_tokens: int, vocab_size: int, budget_bytes: int = 256 * 2**20) -> int:
    """Rows per chunk so that one fp32 [chunk, V] block stays within `budget_bytes` (at least 1)."""
    return max(1, min(num_tokens, budget_bytes // (4 * max(vocab_size, 1))))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.matmul(h, weight.t()).float() / temperature


def check_token_logprobs_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_token_logprobs: need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != (hidden.shape[0],) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_token_logprobs: labels must be int [N={hidden.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"linear_token_logprobs: temperature must be > 0, got {temperature}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_token_logprobs: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")


def label_mask(labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels with ignored ones set to 0 as int64, valid mask); a label outside [0, vocab) that is not
    `IGNORE_INDEX` is an error. Shared by every backend of `linear_token_logprobs`."""
    valid = labels != IGNORE_INDEX
    if bool(((labels < 0) & valid).any()) or bool((labels >= vocab).any()):
        bad = labels[((labels < 0) & valid) | (labels >= vocab)][0].item()
        raise ValueError(f"linear_token_logprobs: label {bad} outside [0, {vocab}) and not {IGNORE_INDEX}")
    return torch.where(valid, labels, 0).long(), valid


def resolve_chunk_size(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: Optional[int]) -> int:
    """Rows per chunk: `chunk_size`, or `default_chunk_size` when None; < 1 is an error."""
    chunk = default_chunk_size(hidden.shape[0], weight.shape[0]) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"linear_token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    return chunk


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, with_entropy):
        n, vocab = hidden.shape[0], weight.shape[0]
        safe, valid = label_mask(labels, vocab)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            z = _chunk_logits(hidden[s : s + chunk_size], weight, temperature)
            lz = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk_size] = lz
            logp[s : s + chunk_size] = z.gather(1, safe[s : s + chunk_size, None]).squeeze(1) - lz
            if with_entropy:
                p = torch.softmax(z, dim=-1)
                ent[s : s + chunk_size] = lz - (p * z).sum(-1)
        logp = torch.where(valid, logp, 0.0)
        ent = torch.where(valid, ent, 0.0) if with_entropy else ent.zero_()
        ctx.save_for_backward(hidden, weight, safe, valid, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, safe, valid, lse, ent = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float() * valid
        use_ent = ctx.with_entropy and grad_ent is not None
        if use_ent:
            grad_ent = grad_ent.float() * valid
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], c):
            h = hidden[s : s + c]
            z = _chunk_logits(h, weight, t)
            logp_all = z - lse[s : s + c, None]
            p = logp_all.exp()
            g = -p * grad_logp[s : s + c, None]
            g.scatter_add_(1, safe[s : s + c, None], grad_logp[s : s + c, None])
            if use_ent:
                g -= p * (logp_all + ent[s : s + c, None]) * grad_ent[s : s + c, None]
            g = (g / t).to(hidden.dtype)
            if need_h:
                grad_h[s : s + c] = torch.matmul(g, weight)
            if need_w:
                grad_w += torch.matmul(g.t(), h).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


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
    check_token_logprobs_inputs(hidden, weight, labels, temperature)
    chunk = resolve_chunk_size(hidden, weight, chunk_size)
    logp, ent = _LinearTokenLogprobs.apply(hidden, weight, labels, float(temperature), chunk, bool(return_entropy))
    return (logp, ent) if return_entropy else logp
