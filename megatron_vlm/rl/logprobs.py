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

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_vlm import kernels
from megatron_vlm.data.batch import shifted_labels
from megatron_vlm.training.masked_vocab import masked_token_logprobs

__all__ = ["response_token_logprobs"]

def response_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    masked_token_ids: Sequence[int] = (),
):
    """log p of each response token (`[N]`, 0 elsewhere), and the entropy of the distribution that
    predicted it when `return_entropy`. Differentiable with respect to `hidden` and the weight.
    `masked_token_ids` (a VLM's vision tokens, which the rollout engines never sample): of the distribution
    with those ids removed, the one the engines sample from (training/masked_vocab.py)."""
    if hidden.dim() != 2 or hidden.shape[0] != input_ids.shape[0]:
        raise ValueError(f"hidden: expected [N, H] with N = {input_ids.shape[0]}, got {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    labels = shifted_labels(input_ids, response_mask, cu_seqlens)
    out = kernels.linear_token_logprobs(hidden, lm_head_weight, labels, temperature=temperature, return_entropy=return_entropy)
    logp, ent = (out if return_entropy else (out, None))
    assert isinstance(logp, torch.Tensor)
    logp, ent = masked_token_logprobs(hidden, lm_head_weight, labels, logp, ent, masked_token_ids, temperature=temperature)
    zero = logp.new_zeros(1)
    logp_tok = torch.cat([zero, logp[:-1]]) * response_mask
    if not return_entropy:
        return logp_tok
    assert isinstance(ent, torch.Tensor)
    ent_tok = torch.cat([zero, ent[:-1]]) * response_mask
    return logp_tok, ent_tok
