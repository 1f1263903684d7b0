"""One rank's share of a step's prompts, encoded, and padded with dummies to the largest share of any rank.

Why padded: FSDP's collectives need every rank to make the same forward calls while decoding in
lock-step, so a rank with fewer valid prompts generates for copies of one of them (not scored, not
trained); a rank with none copies the first prompt another rank encoded, so no bad prompt is met (and counted)
twice. Used by the GRPO step's rounds and by the held-out evaluation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.parallel.collectives import all_reduce_max
from megatron_vlm.rl.prompts.dataset import PromptSample

__all__ = ["EncodedShard", "PromptEncoding", "encode_shard"]


class PromptEncoding(Protocol):
    """What `encode_shard` needs of an encoder (`rl.prompts.encoder.PromptEncoder` or a test stand-in)."""

    def encode(self, sample: PromptSample) -> Optional[RolloutPrompt]: ...


@dataclass
class EncodedShard:
    samples: list[PromptSample]
    """This rank's valid prompts."""
    prompts: list[RolloutPrompt]
    """Their encodings, followed by dummy copies up to the largest shard of any rank."""

    @property
    def num_real(self) -> int:
        return len(self.samples)


def encode_shard(batch: Sequence[PromptSample], encoder: PromptEncoding, rank: int, world: int,
                 device: torch.device) -> EncodedShard:
    """Encode this rank's share of `batch` (round-robin) and pad it with dummies to the largest share."""
    mine: list[PromptSample] = []
    encoded: list[RolloutPrompt] = []
    first_good = len(batch)  # the lowest index of `batch` this rank encoded (len(batch): none)
    for j, s in enumerate(batch[rank::world]):
        e = encoder.encode(s)
        if e is not None:
            mine.append(s)
            encoded.append(e)
            first_good = min(first_good, rank + j * world)
    longest, neg_first = all_reduce_max([len(encoded), -first_good], device)
    if longest == 0:  # every rank sees 0: all raise. Bad data or a model that cannot read it (text-only, images)
        last = getattr(encoder, "last_skip", None)
        raise ConfigError(f"data: none of the {len(batch)} prompts of this step could be encoded"
                          + (f"; the last one skipped: {last}" if last else "") + " (the warnings above name more)")
    if len(encoded) < longest:
        # the filler is a prompt another rank encoded, never one found bad: encoding the list from its start skipped
        # (and counted) again the bad prompts ahead of the first good one, other ranks' shares included
        filler = encoded[0] if encoded else encoder.encode(batch[-neg_first])
        if filler is None:
            raise RuntimeError(f"GRPO: prompt {batch[-neg_first].prompt_id} encoded on one rank and not on this one")
        encoded += [filler] * (int(longest) - len(encoded))
    return EncodedShard(mine, encoded)
