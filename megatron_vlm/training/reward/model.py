"""`ScoreRoot`: the FSDP root of reward-model training — a family model without its lm_head, and a scalar head.

Why a root of its own and not `SequenceScoreModel` (rl/rewards/score_model.py, the scorer's model): training
builds, freezes and shards the model through `build_model_bundle` like every other job kind, whose root holds
the family model as `.model` (the checkpointer, the layout checks and the FSDP wrapping read that name). The
forward is the scorer's: the final-norm hidden state of the last token of each packed sequence, through
`score` in float32, so the exported folder scores exactly what training scored.

The head is `score` [1, hidden] without bias (transformers' `...ForSequenceClassification` layout), drawn from
N(0, std) with a generator seeded by `train.seed`. The lm_head is replaced by nothing: a reward model never
reads the vocabulary projection (a tied embedding stays, as the input embedding).

Data parallelism: in training mode the scores carry a zero-valued anchor on the hidden states and on every
trainable parameter outside the language model's layers (the vision tower, the projector), so a rank whose
pack has no image (or is empty) still produces a gradient for each of them, as FSDP's reduce-scatter needs on
every rank (`TokenLogprobModel` does the same for the policy). The head needs none: it is called on every rank.

Mixed precision: the head stays fp32 (`fp32_weight`: an FSDP2 unit of its own gathered in fp32, or no bf16 copy
with `parallel.fsdp = false`), as the scorer computes it from the exported fp32 weights; in the root's bf16 unit
training scored with its bf16 rounding (up to a few % of a reward apart).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vlm.data.batch import model_inputs
from megatron_vlm.host_copies import on_host

__all__ = ["ScoreRoot", "ScoreHead", "NoLMHead", "head_std"]


class ScoreHead(nn.Linear):
    """The scalar head, kept and computed in fp32 under mixed precision (`fp32_weight`: an FSDP2 unit of its own
    gathered in fp32, no bf16 copy without FSDP2), as the scorer computes it from the exported fp32 head: a
    bf16-rounded head in training scored other values."""

    fp32_weight = True


class NoLMHead(nn.Identity):
    """In place of the lm_head: the hidden states pass through; `weight` is an empty buffer of the head's dtype,
    since some families read `lm_head.weight.dtype` for their vision path."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)


def head_std(hf_config: dict, configured: float) -> float:
    """The head's init std: `configured` when > 0, else the config's `initializer_range` (its text config's for a
    VLM), else 0.02."""
    if configured > 0:
        return float(configured)
    text = hf_config.get("text_config")
    fallback = text.get("initializer_range", 0.02) if isinstance(text, dict) else 0.02
    value = hf_config.get("initializer_range", fallback)
    return float(value if value is not None else 0.02)


class ScoreRoot(nn.Module):
    """`forward(batch) -> rewards [sequences]` (float32): one scalar per sequence of a packed batch."""

    def __init__(self, model: nn.Module, *, std: float, seed: int):
        super().__init__()
        head: Any = model.lm_head
        hidden = int(head.in_features)
        model.lm_head = NoLMHead(head.weight.dtype)
        self.model: Any = model
        self.score = ScoreHead(hidden, 1, bias=False, dtype=torch.float32)
        g = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(self.score.weight.shape, generator=g) * std)

    def _anchor(self, hidden: torch.Tensor) -> torch.Tensor:
        total = hidden.sum().float()
        for name, p in self.named_parameters():
            # the head is its own FSDP2 unit (resharded after its forward: not readable here); it is called on every
            # rank, an empty pack's zero rows included, so it has a gradient everywhere without the anchor
            if p.requires_grad and not name.startswith(("model.language_model.", "score.")):
                total = total + p.sum().float()
        return 0.0 * total

    def forward(self, batch: dict) -> torch.Tensor:
        hidden = self.model(**model_inputs(batch), return_hidden=True)
        # each sequence's last position, worked out on the host copies (megatron_vlm/host_copies.py: no device sync)
        last = on_host(batch["cu_seqlens"])[1:].to(torch.long) - 1
        responses = batch.get("response_segments")
        if responses is not None:  # a shared-prompt pack (training/pair_prompts.py): the segments that end a response
            last = last[on_host(responses) >= 0]
        last = last.to(hidden.device, non_blocking=True)
        pooled = hidden.reshape(-1, hidden.shape[-1])[last].float()
        # called as a module (an FSDP2 unit of its own gathers its weight), in the head's own dtype
        rewards = self.score(pooled.to(self.score.weight.dtype))[:, 0]
        if torch.is_grad_enabled() and self.training:
            rewards = rewards + self._anchor(hidden)
        return rewards
