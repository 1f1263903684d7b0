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
from megatron_vlm.host_copies import host_int, on_host

__all__ = ["pair_sums"]


def pair_sums(logp: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen log p, rejected log p, chosen tokens, rejected tokens), each [pairs]; differentiable in `logp`.

    Which response each label belongs to is worked out on the host, from the host copies of the pack's labels,
    `cu_seqlens` and `response_segments` (megatron_vlm/host_copies.py; no device sync), and moved to the device with the
    copy not waited for; only the sums run on the device."""
    pairs = host_int(batch["num_pairs"])
    labels = on_host(batch["labels"]).reshape(-1)
    positions = torch.nonzero(labels != IGNORE_INDEX).flatten()
    if positions.numel() != logp.numel():
        raise ValueError(f"pair_sums: {logp.numel()} log-probs for {positions.numel()} labelled tokens")
    cu = on_host(batch["cu_seqlens"]).long()
    seq = torch.bucketize(positions, cu[1:], right=True)  # label position -> its sequence
    if batch.get("response_segments") is not None:  # a shared-prompt pack: segment -> response
        seq = on_host(batch["response_segments"])[seq]
    n_seq = 2 * pairs
    if not pairs:
        return logp.new_zeros(0), logp.new_zeros(0), *(torch.zeros(0, dtype=torch.long, device=logp.device),) * 2
    counts = torch.bincount(seq, minlength=n_seq)[:n_seq].to(logp.device, non_blocking=True)
    index = seq.to(logp.device, non_blocking=True)
    sums = torch.zeros(n_seq, dtype=logp.dtype, device=logp.device).index_add(0, index, logp)
    return sums[0::2], sums[1::2], counts[0::2], counts[1::2]
