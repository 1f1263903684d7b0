"""The GRPO held-out evaluation on two gloo ranks: a prompt that cannot be encoded is one skip, whatever the
world size.

Every rank must generate for the same number of prompts, so a rank whose share has no usable prompt pads with
a copy of one that some rank could encode. It found that copy by encoding the whole prompt list from the
start, so the bad prompts ahead of the first good one (other ranks' shares included) were skipped and counted
again: the run's bad-record summary said 2 skips for a prompt the evaluation met once."""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from megatron_vlm.data.bad_records import BadRecordLog, merge_by_shard
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.parallel.collectives import all_gather_objects
from megatron_vlm.rl.prompts.dataset import PromptDataset, PromptSample
from tests.integration.parallel.spawn import spawn
from tests.unit.eval.bench_harness import AnswerEngine


class _Encoder:
    """Prompts whose answer is "bad" cannot be encoded: skipped and logged (as PromptEncoder does)."""

    def __init__(self):
        self.bad_records, self.skipped, self.calls = BadRecordLog(), 0, []

    def encode(self, s: PromptSample):
        self.calls.append(s.prompt_id)
        if s.answer == "bad":
            self.skipped += 1
            self.bad_records.add(s.source, s.index, "too_long", "stand-in")
            return None
        return RolloutPrompt(input_ids=torch.tensor([1, 2]))


class _Manager:
    def score(self, texts, answers, prompts, metas, only):
        return NS(per_reward={only[0]: [float(t == a) for t, a in zip(texts, answers)]})


def _samples(answers):
    return [PromptSample(f"p{i}", [], a, f"q{i}", source="held.jsonl", index=i + 1) for i, a in enumerate(answers)]


def _evaluate(rank: int, world: int, answers: list[str]):
    from megatron_vlm.eval.grpo_accuracy import evaluate_accuracy

    ctx = NS(env=NS(rank=rank, world_size=world, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    rl = NS(eval=NS(max_prompts=0, max_new_tokens=2, k=1, temperature=0.0, top_p=1.0, correct_threshold=1.0),
            rollout=NS(max_new_tokens=2, stop=[]), accuracy_label=lambda: "math")
    enc = _Encoder()
    wrapper = NS(eval=lambda: None, train=lambda: None)
    metrics = evaluate_accuracy(ctx, wrapper, rl, AnswerEngine("4"), enc, _Manager(), PromptDataset(_samples(answers), "messages"), 0)
    merged = merge_by_shard(all_gather_objects((rank, enc.bad_records.to_dict()["records"])))
    return metrics, merged.to_dict(), sum(all_gather_objects(enc.skipped))


def _part(tmp, rank: int) -> None:
    # round-robin shards: rank 0 holds p0 and p2 (both bad), rank 1 holds p1 (good) and p3 (bad)
    metrics, bad, skipped = _evaluate(rank, 2, ["bad", "4", "bad", "bad"])
    assert metrics["num_prompts"] == 1.0 and metrics["accuracy"] == 1.0 and metrics["skipped_prompts"] == 3.0
    assert bad["num_bad_records"] == 3
    assert bad["num_skips"] == 3, bad["records"]  # each bad prompt met once
    assert skipped == 3


def test_bad_prompts_counted_once_on_two_ranks(tmp_path):
    spawn(tmp_path, _part)


def test_a_held_out_set_of_bad_prompts_is_counted_not_fatal():
    """None of the held-out prompts encodes: the evaluation reports 0 prompts and the skips (it raised the training
    step's "none of the prompts could be encoded" ConfigError, stopping a run in the middle of training)."""
    metrics, bad, skipped = _evaluate(0, 1, ["bad", "bad"])
    assert metrics == {"num_prompts": 0.0, "skipped_prompts": 2.0}
    assert bad["num_skips"] == skipped == 2
