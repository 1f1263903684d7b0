"""The asynchronous trainer's check that it re-encoded each group's prompt to the tokens the rollout rank generated after.

Why: the trainer encodes each group's prompt again (images are not sent over the bridge), and the samples' response
tokens, behaviour log-probs and recorded MoE routes (prompt + L - 1 rows, routing replay) belong to the rollout rank's
prompt. An encoding that differs between processes (e.g. an [rl.env] environment whose `tools()` lists its specs in
no fixed order, a chat template reading the clock) would train them after a context the rollout never saw: every
log-prob and ratio of the group wrong, silently. The rollout rank sends the prompt's length and a digest of its ids
with each sample; a mismatch stops the run naming the prompt.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["prompt_digest", "check_same_prompt"]


def prompt_digest(input_ids: torch.Tensor) -> str:
    """A 64-bit digest of a prompt's token ids (as int64, so either side's dtype gives the same bytes)."""
    data = input_ids.detach().reshape(-1).to(device="cpu", dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def check_same_prompt(sample: Any, enc: Any, samples: Sequence[dict]) -> None:
    """Refuse (RuntimeError naming the prompt) `enc`, this trainer's encoding of `sample`, where the rollout rank's
    payload `samples` say it encoded another length, or other ids of that length (a payload without a digest, from
    a rollout rank of an older version, is checked by length only)."""
    n = len(enc)
    other = next((int(s["prompt_length"]) for s in samples if int(s["prompt_length"]) != n), None)
    if other is not None:
        raise RuntimeError(f"asynchronous GRPO: prompt {sample.prompt_id}: {n} tokens here, {other} on the "
                           "rollout rank: its encoding differs between processes (e.g. an [rl.env] environment whose "
                           "tools() lists its specs in no fixed order)")
    digests = {s["prompt_digest"] for s in samples if s.get("prompt_digest") is not None}
    if digests and digests != {prompt_digest(enc.input_ids)}:
        raise RuntimeError(f"asynchronous GRPO: prompt {sample.prompt_id}: {n} tokens here and on the rollout rank, "
                           "but other token ids: its encoding differs between processes (e.g. an [rl.env] environment "
                           "whose tools() lists its specs in no fixed order)")
