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


def test_other_ids_of_the_same_length_are_refused():
    """The payload's digest of the rollout rank's prompt ids ([5, 7, 6]: the same length as the trainer's [5, 6, 7])."""
    from megatron_vlm.rl.asynchronous.prompt_check import prompt_digest

    payload = _payload(0, [1, 2])
    for s in payload["samples"]:
        s["prompt_digest"] = prompt_digest(torch.tensor([5, 7, 6]))
    with pytest.raises(RuntimeError, match=r"prompt p1: 3 tokens here and on the rollout rank, but other token ids"):
        _trainer(0)._round(0, [payload])
    for s in payload["samples"]:  # the same ids, sent as another integer dtype
        s["prompt_digest"] = prompt_digest(torch.tensor([5, 6, 7], dtype=torch.int32))
    assert [len(p) for p in _trainer(0)._round(0, [payload]).shard.prompts] == [3]


def test_the_rollout_rank_sends_each_samples_prompt_digest():
    from megatron_vlm.rl.asynchronous.prompt_check import prompt_digest
    from megatron_vlm.rl.asynchronous.rollout_rank import _sample_payload

    digests = [prompt_digest(torch.tensor([1, 2])), prompt_digest(torch.tensor([1, 3]))]
    assert digests[0] != digests[1]
    sample = NS(prompt_index=1, sample_index=0, token_ids=None, logprobs=None, token_versions=None, text="",
                finish_reason="eos", prompt_length=2, routes=None)
    assert _sample_payload(sample, digests)["prompt_digest"] == digests[1]
