"""Token log-probabilities of a causal VLM without materialising [T, vocab] logits.

`TokenLogprobModel` wraps the family model so that the output projection runs inside the wrapper's
forward: under FSDP2 the wrapper is the root unit, so `lm_head.weight` is the gathered parameter
there, and `megatron_vlm.kernels.linear_token_logprobs` (chunked over the vocabulary) can consume
it directly. Only positions with a label (labels are pre-shifted; -100 = ignore) are computed.
Shared by SFT (loss = -sum logp / global token count) and GRPO (policy / reference log-probs).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.data.batch import label_positions, model_inputs
from megatron_vlm.parallel.tensor_parallel import is_vocab_parallel, vocab_parallel_token_logprobs
from megatron_vlm.training.masked_vocab import masked_token_logprobs

# The fused log-prob's [rows, V] fp32 temporaries (logits, probabilities, their gradient: about ten per
# forward + backward) are fresh allocations. On the CPU a block of several MB is a new mapping each time
# (page faults on first touch) that does not stay in the cache; blocks of ~2 MB are reused by the allocator
# and stay in L2 / L3. At the GRPO benchmark's shape (2048 rows, V = 1024) 512-row chunks take ~0.6x the
# CPU time of one 2048-row block (tests/unit/training/test_lm_loss_chunks.py checks the values are equal).
# Rows are kept >= 256 so that large vocabularies still run matmuls of a useful size; GPUs keep the
# kernel's own default (None).
CPU_BLOCK_BYTES = 2 << 20
CPU_MIN_ROWS = 256


def cpu_chunk_rows(hidden: torch.Tensor, vocab: int) -> int | None:
    """Rows per chunk of `kernels.linear_token_logprobs` for `hidden` on the CPU (see above); None elsewhere."""
    if hidden.device.type != "cpu":
        return None
    return max(CPU_MIN_ROWS, CPU_BLOCK_BYTES // (4 * max(int(vocab), 1)))


class TokenLogprobModel(nn.Module):
    """Under data parallelism every rank must produce gradients for the same parameters (FSDP
    reduce-scatters per group): a rank whose micro-batch has no image, or no trained token at all,
    would otherwise leave the vision tower (or everything) without gradients and hang the others.
    In training mode the returned log-probs therefore carry a zero-valued anchor that depends on
    the hidden states and on every trainable parameter outside the language model's layers."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model: Any = model  # a family model: lm_head, hf_config, ... are read by name

    def _anchor(self, hidden: torch.Tensor) -> torch.Tensor:
        total = hidden.sum()
        for name, p in self.model.named_parameters():
            if p.requires_grad and not name.startswith(("language_model.", "lm_head.")):
                total = total + p.sum()
        return 0.0 * total

    def forward(self, batch: dict | None = None, *, temperature: float = 1.0, return_entropy: bool = False,
                model_kwargs: dict | None = None, masked_token_ids: Sequence[int] = ()):
        """Token log-probs of `batch["labels"]`; or, with `model_kwargs`, the plain model output
        (logits, hidden states, KV-cache decoding) computed inside the FSDP root's forward.
        `masked_token_ids`: of the softmax with those ids removed (GRPO passes the vision tokens the rollout
        engines never sample: training/masked_vocab.py); SFT and DPO pass none (the full softmax)."""
        if model_kwargs is not None:
            return self.model(**model_kwargs)
        assert batch is not None, "pass batch (log-probs) or model_kwargs (the plain model output)"
        hidden = self.model(**model_inputs(batch), return_hidden=True)
        # the trained positions, from the labels' host copy (megatron_vlm/host_copies.py): a bool-mask index
        # would read the device (its count) after the decoder's forward
        pos = label_positions(batch["labels"])
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pos)
        targets = batch["labels"].reshape(-1).index_select(0, pos)
        weight: torch.Tensor = self.model.lm_head.weight
        # tensor parallelism: the lm_head rows are split over the tp ranks; log-probs without gathering them
        if not is_vocab_parallel(weight):
            out = kernels.linear_token_logprobs(h, weight, targets, temperature=temperature,
                                                return_entropy=return_entropy, chunk_size=cpu_chunk_rows(h, weight.shape[0]))
            if masked_token_ids:
                full, full_ent = (out if isinstance(out, tuple) else (out, None))
                logp_q, ent_q = masked_token_logprobs(h, weight, targets, full, full_ent, masked_token_ids,
                                                      temperature=temperature)
                out = (logp_q, ent_q) if return_entropy else logp_q
        else:
            out = vocab_parallel_token_logprobs(h, weight, targets, temperature=temperature,
                                                return_entropy=return_entropy, masked_token_ids=masked_token_ids)
        if torch.is_grad_enabled() and self.training:
            anchor = self._anchor(hidden).to(torch.float32)
            logp = out[0] if isinstance(out, tuple) else out
            logp = logp + anchor if logp.numel() else anchor.reshape(1)[:0]
            out = (logp, *out[1:]) if isinstance(out, tuple) else logp
        return out
