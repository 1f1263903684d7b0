"""Per-token log-probabilities of response tokens from final hidden states, without full logits.

GRPO needs log pi(token) of every generated token under the policy (train and proximal passes) and
the reference model. The model returns final hidden states for a packed batch (`[N, H]`, sequences
concatenated, `cu_seqlens` marking their boundaries); the LM head and log-softmax are fused and
chunked over the vocabulary by `megatron_vlm.kernels.linear_token_logprobs`, so the `[N, V]`
logits never exist (V = 151k for Qwen).

Alignment: the token at position t is predicted by the hidden state at t - 1 of the same sequence.
Results are indexed by the *token* position (out[t] = log p(input_ids[t] | ...)), non-zero only
where `response_mask[t]` is True, which is the layout `rl.losses.policy_loss` takes.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_vlm import kernels

__all__ = ["response_token_logprobs", "shifted_labels"]

IGNORE_INDEX = -100


def shifted_labels(input_ids: torch.Tensor, response_mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """labels[i] = input_ids[i + 1] where token i + 1 is a response token of the same sequence, else -100."""
    if input_ids.dim() != 1 or response_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and response_mask {tuple(response_mask.shape)} must be one packed [N] shape"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask: must be bool, got {response_mask.dtype}")
    n = input_ids.numel()
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if n < 2:
        return labels
    nxt = response_mask[1:].clone()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens: must rise from 0 to N = {n}, got {cu.tolist()[:8]}")
        if bool(response_mask[cu[:-1].clamp_max(n - 1)].any()):
            raise ValueError("response_mask: the first token of a sequence cannot be a response token (nothing predicts it)")
        last = cu[1:-1] - 1  # final position of every sequence but the last: its next token belongs to another sequence
        nxt[last[last >= 0]] = False
    elif bool(response_mask[0]):
        raise ValueError("response_mask: the first token cannot be a response token (nothing predicts it)")
    labels[:-1] = torch.where(nxt, input_ids[1:], torch.full_like(input_ids[1:], IGNORE_INDEX))
    return labels


def response_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """log p of each response token (`[N]`, 0 elsewhere), and the entropy of the distribution that
    predicted it when `return_entropy`. Differentiable with respect to `hidden` and the weight."""
    if hidden.dim() != 2 or hidden.shape[0] != input_ids.shape[0]:
        raise ValueError(f"hidden: expected [N, H] with N = {input_ids.shape[0]}, got {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    labels = shifted_labels(input_ids, response_mask, cu_seqlens)
    out = kernels.linear_token_logprobs(hidden, lm_head_weight, labels, temperature=temperature, return_entropy=return_entropy)
    logp, ent = (out if return_entropy else (out, None))
    zero = logp.new_zeros(1)
    logp_tok = torch.cat([zero, logp[:-1]]) * response_mask
    if not return_entropy:
        return logp_tok
    ent_tok = torch.cat([zero, ent[:-1]]) * response_mask
    return logp_tok, ent_tok
