"""Rollout samples -> packed training micro-batches, and per-token tensors back to samples.

A training sample is one completion with its prompt: tokens prompt + response, the response's
behaviour log-probs, its (scalar) advantage, and later its reference / old-policy log-probs. Samples
are packed into micro-batches of at most `max_tokens` tokens (the SFT layout: `input_ids` [1, T],
`cu_seqlens` so attention and M-RoPE positions restart per sample, images of all samples
concatenated in order), with pre-shifted `labels` that are set exactly where the next token is a
response token (`data.batch.shifted_labels`). `TokenLogprobModel` returns the log-probs of the
labelled positions in order, i.e. the response tokens of the micro-batch concatenated sample by
sample — the layout `split_by_response` undoes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_vlm.data.batch import VISION_KEYS, shifted_labels
from megatron_vlm.rl.rollout.engine import RolloutPrompt

__all__ = ["TrainSample", "plan_micro_batches", "pack_samples", "split_by_response"]



@dataclass
class TrainSample:
    prompt: RolloutPrompt
    response_ids: torch.Tensor
    """[L] generated tokens (L >= 1)."""
    behav_logp: torch.Tensor
    """[L] behaviour log-probs from the rollout engine."""
    advantage: float
    old_logp: Optional[torch.Tensor] = None
    """[L] log-probs of the policy the PPO ratio is taken against (behav_logp unless recomputed)."""
    ref_logp: Optional[torch.Tensor] = None
    """[L] reference-model log-probs (kl_coef > 0)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + int(self.response_ids.numel())

    @property
    def response_length(self) -> int:
        return int(self.response_ids.numel())


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sample indices, each summing to at most max_tokens (a longer sample is
    an error: the prompt encoder already bounds prompt + max_new_tokens)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i}: {n} tokens exceed the micro-batch budget of {max_tokens} (data.max_tokens_per_pack)")
        if current and used + n > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def pack_samples(samples: Sequence[TrainSample]) -> dict:
    """One packed micro-batch (CPU tensors) for `TokenLogprobModel` / the family model."""
    if not samples:
        raise ValueError("pack_samples: no samples")
    ids, resp, cu = [], [], [0]
    vision: dict[str, list[torch.Tensor]] = {k: [] for k in VISION_KEYS}
    for s in samples:
        p_ids = s.prompt.input_ids.to(torch.long)
        ids += [p_ids, s.response_ids.to(torch.long)]
        resp += [torch.zeros(p_ids.numel(), dtype=torch.bool), torch.ones(s.response_length, dtype=torch.bool)]
        cu.append(cu[-1] + s.num_tokens)
        for k in VISION_KEYS:
            v = getattr(s.prompt, k)
            if v is not None:
                vision[k].append(v)
    input_ids = torch.cat(ids)
    response_mask = torch.cat(resp)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    batch = {
        "input_ids": input_ids[None],
        "cu_seqlens": cu_seqlens,
        "labels": shifted_labels(input_ids, response_mask, cu_seqlens)[None],
        "num_response_tokens": int(response_mask.sum()),
    }
    for k, parts in vision.items():
        if parts:
            batch[k] = torch.cat(parts)
    return batch


def split_by_response(values: torch.Tensor, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
    """Per-sample [L_i] pieces of a micro-batch's concatenated per-response-token vector."""
    lengths = [s.response_length for s in samples]
    if values.numel() != sum(lengths):
        raise ValueError(f"values: {values.numel()} entries for {sum(lengths)} response tokens")
    return list(torch.split(values, lengths))
