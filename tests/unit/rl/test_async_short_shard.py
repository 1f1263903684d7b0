"""Asynchronous GRPO: a step whose prompts the rollout ranks could not all encode still trains on every data shard.

The trainer deals a step's groups round-robin over its data shards. With 2 shards and `rl.batch.prompts_per_step = 2`
(the start-up check's minimum), one prompt skipped mid-run (pixels that cannot be decoded: a counted bad record)
left shard 1 without a group, and the trainer raised "raise rl.batch.prompts_per_step" (exit 1) at that step, again
after every resume. The synchronous loop trains such a rank on a dummy (loss x 0) and goes on; so does this one now.
A step none of whose prompts could be encoded stops the run as the synchronous loop's does: exit 2 naming the data.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.algorithms.advantage_estimators import AdvantageSpec
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.config import RLConfig
from megatron_vlm.rl.grpo_step import GRPOStep

G = 2


class _Encoder:
    def encode(self, sample):
        return RolloutPrompt(input_ids=torch.tensor([5, 6, 7 + sample]))


def _trainer(shard_rank: int) -> AsyncGRPOLoopStep:
    rl = RLConfig()
    rl.batch.group_size = G
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.rl, t.advantage, t.encoder, t.train_set = rl, AdvantageSpec.from_config(rl), _Encoder(), list(range(8))
    t.grpo = SimpleNamespace(shards=SimpleNamespace(rank=shard_rank, world=2), reward_labels=["math"])
    return t


def _payload(step: int, indices: list[int]) -> dict:
    samples = [{"prompt_index": pi, "sample_index": j, "token_ids": torch.tensor([9, 10]), "logprobs": torch.zeros(2),
                "token_versions": torch.full((2,), step), "text": "x", "finish_reason": "eos", "prompt_length": 3,
                "routes": None} for pi in range(len(indices)) for j in range(G)]
    n = len(samples)
    return {"step": step, "indices": indices, "samples": samples, "total": [float(i % 2) for i in range(n)],
            "per_reward": {"math": [float(i % 2) for i in range(n)]}, "skipped": 1,
            "bad_records": [{"source": "p.jsonl", "index": 4, "category": "corrupt_image", "detail": "truncated",
                             "skips": 1}]}


def test_a_shard_left_without_a_group_trains_on_a_dummy():
    """Prompt 3 of step 0 was skipped: one group for two shards. Shard 0 trains on it, shard 1 on nothing real."""
    payloads = [_payload(0, [1])]
    rd0 = _trainer(0)._round(0, payloads)
    assert rd0.shard.num_real == 1 and len(rd0.real) == G and rd0.keep_group == [True]
    rd1 = _trainer(1)._round(0, payloads)
    assert rd1.shard.num_real == 0 and rd1.real == [] and rd1.keep_group == [] and rd1.adv is None
    dummy = GRPOStep._dummy(rd1)  # what its update forwards with loss x 0, as a short rank of the synchronous loop
    assert dummy.advantage == 0.0 and dummy.response_ids.numel() > 0


def test_a_step_with_no_encodable_prompt_is_a_data_error():
    with pytest.raises(ConfigError, match=r"^data: none of the prompts of step 0 could be encoded.*p\.jsonl:4"):
        _trainer(0)._round(0, [_payload(0, []) | {"samples": [], "total": [], "per_reward": {}}])


def test_the_dummy_round_goes_through_the_update_without_changing_the_policy():
    """The synchronous step's update on the dummy round (a tiny stand-in policy, SGD): it runs, trains on nothing."""
    from test_review_grpo_update import TinyPolicy, _step

    from megatron_vlm.rl.metrics import PhaseTimer

    rd = _trainer(1)._round(0, [_payload(0, [1])])
    policy = TinyPolicy()
    before = [p.detach().clone() for p in policy.parameters()]
    out = _step(policy, lambda s: 1.0, mini_batches=1).train_on_rounds(0, [rd], PhaseTimer())
    assert out["rollout/prompts"] == 0.0
    for a, b in zip(policy.parameters(), before):
        assert torch.equal(a, b)


class _FlakyEncoder(_Encoder):
    """The trainer's encoder, which cannot read prompt 1 at this step (its video decode timed out on the busy trainer,
    its file was unreadable for a moment) though the rollout rank could: a skipped prompt, counted."""

    def __init__(self, fails: set):
        self.fails, self.skipped = fails, 0

    def encode(self, sample):
        if sample in self.fails:
            self.skipped += 1
            return None
        return super().encode(sample)


def test_a_prompt_the_trainer_cannot_encode_again_is_skipped_not_fatal():
    """Before: "prompt 1 encoded on the rollout rank but not here", a crash of the run (the work since the newest
    checkpoint lost) for a prompt the synchronous loop skips and counts. Now its group is left out of the step."""
    t = _trainer(0)
    t.grpo = SimpleNamespace(shards=SimpleNamespace(rank=0, world=1), reward_labels=["math"])
    t.encoder = _FlakyEncoder({1})
    rd = t._round(0, [_payload(0, [1, 2])])
    assert t.encoder.skipped == 1
    assert rd.shard.samples == [2] and rd.shard.num_real == 1 and len(rd.real) == G
    assert [s.prompt_index for s in rd.real] == [0] * G  # the kept group's samples, renumbered as the shard's first
    assert rd.total == [0.0, 1.0] and rd.per_reward == {"math": [0.0, 1.0]}  # the second group's rewards
    # every group of this shard unreadable here: the shard trains on a dummy made of a prompt it can read (loss x 0)
    t2 = _trainer(1)
    t2.encoder = _FlakyEncoder({2})
    rd2 = t2._round(0, [_payload(0, [1, 2])])
    assert rd2.shard.num_real == 0 and rd2.real == [] and GRPOStep._dummy(rd2).advantage == 0.0
