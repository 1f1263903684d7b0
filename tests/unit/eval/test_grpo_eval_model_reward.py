"""The GRPO held-out evaluation scores a model reward as training does: on the prompt's own messages.

Found by reading the evaluation path: a round hands the reward models the prompts' messages (their images,
system turn) through `CombinedRewards.score(samples=...)`, but the held-out evaluation passed only the question
text, so a reward model (or judge) chosen as the accuracy reward scored every held-out completion without the
image it is about, a different input from the one it scores in training, and without a word.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.prompts.dataset import PromptDataset, PromptSample
from megatron_vlm.rl.rewards.combined import CombinedRewards
from megatron_vlm.rl.rewards.config import ModelRewardConfig
from megatron_vlm.rl.rewards.model_reward import ScoredValues
from tests.unit.eval.bench_harness import AnswerEngine


class _Encoder:
    skipped = 0

    def encode(self, s: PromptSample):
        return RolloutPrompt(input_ids=torch.tensor([1, 2]))


class _Scorer:
    """A reward model stand-in: 1 when the completion's conversation shows an image, else 0; keeps what it saw."""

    def __init__(self):
        self.seen: list[list[dict]] = []

    def score(self, texts, messages):
        self.seen += [list(m) for m in messages]
        shows = [any(isinstance(m["content"], list) and any(it.get("type") == "image" for it in m["content"])
                     for m in msgs) for msgs in messages]
        return ScoredValues(values=[float(s) for s in shows], status=["ok"] * len(texts), detail=[""] * len(texts))


def test_a_model_accuracy_reward_sees_the_held_out_prompts_images():
    from megatron_vlm.eval.grpo_accuracy import evaluate_accuracy

    messages = [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": [{"type": "image", "image": "/img/a.png"}, {"type": "text", "text": "Colour?"}]}]
    samples = [PromptSample(f"p{i}", messages, "red", "Colour?", source="held.jsonl", index=i + 1) for i in range(2)]
    scorer = _Scorer()
    manager = CombinedRewards([ModelRewardConfig(path="/rm", name="rm")], scorers={0: scorer})
    ctx = NS(env=NS(rank=0, world_size=1, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    rl = NS(eval=NS(max_prompts=0, max_new_tokens=2, k=2, temperature=0.0, top_p=1.0, correct_threshold=0.5),
            rollout=NS(max_new_tokens=2, stop=[]), accuracy_label=lambda: "rm")
    wrapper = NS(eval=lambda: None, train=lambda: None)
    metrics = evaluate_accuracy(ctx, wrapper, rl, AnswerEngine("red"), _Encoder(), manager, PromptDataset(samples, "messages"), 0)
    assert len(scorer.seen) == 4  # 2 prompts x k = 2
    assert all(seen == messages for seen in scorer.seen), scorer.seen[0]
    assert metrics is not None and metrics["accuracy"] == 1.0
