"""One rank's share of a step's prompts, encoded, and padded with dummies to the largest share of any rank.

Why padded: FSDP's collectives need every rank to make the same forward calls while decoding in
lock-step, so a rank with fewer valid prompts generates for copies of one of them (not scored, not
trained). Used by the GRPO step's rounds and by the held-out evaluation.
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
    for s in batch[rank::world]:
        e = encoder.encode(s)
        if e is not None:
            mine.append(s)
            encoded.append(e)
    (longest,) = all_reduce_max([len(encoded)], device)
    if longest == 0:  # every rank sees 0: all raise. Bad data or a model that cannot read it (text-only, images)
        last = getattr(encoder, "last_skip", None)
        raise ConfigError(f"data: none of the {len(batch)} prompts of this step could be encoded"
                          + (f"; the last one skipped: {last}" if last else "") + " (the warnings above name more)")
    if len(encoded) < longest:
        filler = encoded[0] if encoded else next((e for e in map(encoder.encode, batch) if e is not None), None)
        if filler is None:
            raise RuntimeError("GRPO: this rank has no valid prompt to pad its share with")
        encoded += [filler] * (int(longest) - len(encoded))
    return EncodedShard(mine, encoded)
