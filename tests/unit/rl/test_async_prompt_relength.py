"""Asynchronous GRPO: the trainer encodes each group's prompt again (`_round`); a prompt it encodes to another length
than the rollout rank did is refused, naming the prompt and both lengths.

Why: the samples' response tokens, behaviour log-probs and recorded MoE routes (routing replay: prompt + L - 1 rows)
belong to the rollout rank's prompt. Trained after another prompt they were silently scored in a context the rollout
never saw (a text policy: every log-prob and ratio of the group wrong), or, with routes, failed later in the update
with a pack-layout error that did not say why. Hand-built: the trainer's encoder gives 3 tokens, the payload says 3 or 4.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt
from tests.unit.rl.test_async_short_shard import _payload
from tests.unit.rl.test_async_short_shard import _trainer as _short_shard_trainer


def _trainer(shard_rank: int):
    t = _short_shard_trainer(shard_rank)
    t.train_set = [NS(prompt_id=f"p{i}") for i in range(8)]
    t.encoder = NS(encode=lambda s: RolloutPrompt(input_ids=torch.tensor([5, 6, 7])))
    return t


def test_the_same_length_is_trained():
    rd = _trainer(0)._round(0, [_payload(0, [1, 2])])
    assert [len(p) for p in rd.shard.prompts] == [3] and rd.real[0].prompt_length == 3


def test_another_length_is_refused_naming_the_prompt():
    payload = _payload(0, [1, 2])
    for s in payload["samples"]:
        s["prompt_length"] = 4  # what the rollout rank encoded
    with pytest.raises(RuntimeError, match=r"prompt p1: 3 tokens here, 4 on the rollout rank"):
        _trainer(0)._round(0, [payload])
