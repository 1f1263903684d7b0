"""The GRPO / PPO micro-batch planners look at each sample's vision shapes a bounded number of times.

Why: the check that keeps Nemotron-VL videos of two tile sizes apart (rl/batching.py `vision_conflict`) merged the
shapes of every sample already in the pack for each sample that joined it, so planning a pack of n samples took
~n^2 / 2 looks: about 1 s for 4,096 short text samples per rank, paid in every `packs` call of a step (old and
reference log-probs, each update epoch). The planners now keep the pack's shapes as it grows.
"""
from __future__ import annotations

import pytest
import torch

import megatron_vlm.data.packing as packing
import megatron_vlm.rl.batching as batching
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.batching import TrainSample, plan_micro_batches, plan_shared_micro_batches


def _samples(prompts: int, group: int) -> list[TrainSample]:
    shared = [RolloutPrompt(input_ids=torch.arange(20)) for _ in range(prompts)]
    return [TrainSample(prompt=shared[i // group], response_ids=torch.arange(6), behav_logp=torch.zeros(6), advantage=1.0)
            for i in range(prompts * group)]


@pytest.mark.parametrize("planner", ["plain", "shared"])
def test_planning_looks_at_each_sample_a_bounded_number_of_times(planner, monkeypatch):
    looks = {"n": 0}
    original = packing.vision_shapes

    def counted(item):
        looks["n"] += 1
        return original(item)

    monkeypatch.setattr(packing, "vision_shapes", counted)
    monkeypatch.setattr(batching, "vision_shapes", counted)
    samples = _samples(50, 8)  # 400 samples, one pack
    plan = (plan_micro_batches([s.num_tokens for s in samples], 1 << 20, samples) if planner == "plain"
            else plan_shared_micro_batches(samples, 1 << 20))
    assert plan == [list(range(len(samples)))]
    assert looks["n"] <= 4 * len(samples), looks["n"]
