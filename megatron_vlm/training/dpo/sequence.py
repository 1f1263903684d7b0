"""Per-response sums of the token log-probs of a packed preference batch.

`TokenLogprobModel` returns the log-probs of the labelled tokens of a pack, in order; the pack's
`cu_seqlens` say which sequence each label belongs to, and the preference loader puts pair k's chosen
and rejected responses in sequences 2k and 2k + 1 (data/preference_loader.py), or, in a pack whose prompts are
shared, the segment -> response map `response_segments` (training/pair_prompts.py) says which. `pair_sums` turns
the flat log-probs into the four [pairs] tensors every preference loss takes.
"""
from __future__ import annotations

import torch

from megatron_vlm.data.batch import IGNORE_INDEX

__all__ = ["pair_sums"]


def pair_sums(logp: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen log p, rejected log p, chosen tokens, rejected tokens), each [pairs]; differentiable in `logp`."""
    pairs = int(batch["num_pairs"])
    labels = batch["labels"].reshape(-1)
    positions = torch.nonzero(labels != IGNORE_INDEX).flatten()
    if positions.numel() != logp.numel():
        raise ValueError(f"pair_sums: {logp.numel()} log-probs for {positions.numel()} labelled tokens")
    cu = batch["cu_seqlens"].to(device=positions.device, dtype=torch.long)
    seq = torch.bucketize(positions, cu[1:], right=True)  # label position -> its sequence
    if batch.get("response_segments") is not None:  # a shared-prompt pack: segment -> response
        seq = batch["response_segments"].to(seq.device)[seq]
    n_seq = 2 * pairs
    sums = torch.zeros(n_seq, dtype=logp.dtype, device=logp.device).index_add(0, seq[:logp.numel()].to(logp.device), logp) \
        if pairs else logp.new_zeros(0)
    counts = torch.bincount(seq, minlength=n_seq)[:n_seq] if pairs else torch.zeros(0, dtype=torch.long)
    counts = counts.to(logp.device)
    return sums[0::2], sums[1::2], counts[0::2], counts[1::2]
