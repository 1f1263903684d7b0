"""Token log-probabilities of a causal VLM without materialising [T, vocab] logits.

`TokenLogprobModel` wraps the family model so that the output projection runs inside the wrapper's
forward: under FSDP2 the wrapper is the root unit, so `lm_head.weight` is the gathered parameter
there, and `megatron_vlm.kernels.linear_token_logprobs` (chunked over the vocabulary) can consume
it directly. Only positions with a label (labels are pre-shifted; -100 = ignore) are computed.
Shared by SFT (loss = -sum logp / global token count) and GRPO (policy / reference log-probs).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_vlm import kernels

MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
    "video_grid_thw", "second_per_grid_ts", "position_ids", "cu_seqlens",
)


class TokenLogprobModel(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict | None = None, *, temperature: float = 1.0, return_entropy: bool = False,
                model_kwargs: dict | None = None):
        """Token log-probs of `batch["labels"]`; or, with `model_kwargs`, the plain model output
        (logits, hidden states, KV-cache decoding) computed inside the FSDP root's forward."""
        if model_kwargs is not None:
            return self.model(**model_kwargs)
        inputs = {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}
        hidden = self.model(**inputs, return_hidden=True)
        labels = batch["labels"].reshape(-1)
        sel = labels != -100
        h = hidden.reshape(-1, hidden.shape[-1])[sel]
        weight = self.model.lm_head.weight
        out = kernels.linear_token_logprobs(
            h, weight, labels[sel], temperature=temperature, return_entropy=return_entropy
        )
        return out
