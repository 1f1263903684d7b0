"""The GRPO held-out evaluation with `rl.rollout.weights = "copy"`: the engine decodes with its own copy of the policy,
which the step refreshes once at its start (`GRPOStep.run`: `load_weights(None, version=step)`), before the update.
An evaluation after step N must score the policy of N updates: it evaluated the copy of the step's start, one
update behind the trainer (and the final evaluation the policy before the last update), without a word."""
from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import torch

from megatron_vlm.eval.grpo_accuracy import evaluate_accuracy
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.rl.prompts.dataset import PromptDataset, PromptSample
from tests.fixtures.rollout_engine import make_engine, tiny_vl_model_and_prompts


class _Tok:
    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):  # noqa: ARG002
        return " ".join(str(i) for i in ids)


class _Encoder:
    skipped = 0

    def __init__(self, prompts):
        self.prompts = prompts

    def encode(self, s: PromptSample):
        return self.prompts[s.index]


class _Manager:
    """Records the completions it is asked to score (the evaluation's texts)."""

    def __init__(self):
        self.texts: list[str] = []

    def score(self, texts, answers, prompts, metas, only):  # noqa: ARG002
        self.texts += list(texts)
        return NS(per_reward={only[0]: [0.0] * len(texts)})


def _greedy_texts(model, prompts, new_tokens: int) -> list[str]:
    eng = make_engine(copy.deepcopy(model), _Tok(), eos_token_ids=[-1])
    out = eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, n=1, temperature=0.0))
    return [s.text for s in out.samples]


def test_evaluation_after_an_update_scores_the_updated_policy():
    trainer, prompts = tiny_vl_model_and_prompts(3)
    engine = make_engine(copy.deepcopy(trainer), _Tok(), eos_token_ids=[-1], sync_from=trainer)
    engine.load_weights(None, version=0)  # step 0 starts: the copy refreshed from the trainer
    with torch.no_grad():  # step 0's update
        g = torch.Generator().manual_seed(3)
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    before, after = _greedy_texts(engine.model, prompts, 4), _greedy_texts(trainer, prompts, 4)
    assert before != after  # the update changes the greedy completions
    ctx = NS(env=NS(rank=0, world_size=1, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    rl = NS(eval=NS(max_prompts=0, max_new_tokens=4, k=1, temperature=0.0, top_p=1.0, correct_threshold=1.0),
            rollout=NS(max_new_tokens=4, stop=[]), accuracy_label=lambda: "acc")
    samples = [PromptSample(f"p{i}", [], "x", f"q{i}", source="held.jsonl", index=i) for i in range(len(prompts))]
    manager = _Manager()
    wrapper = NS(eval=lambda: None, train=lambda: None)
    metrics = evaluate_accuracy(ctx, wrapper, rl, engine, _Encoder(prompts), manager, PromptDataset(samples, "messages"), 1)
    assert metrics is not None and metrics["num_prompts"] == len(prompts)
    assert manager.texts == after, "the evaluation after step 1 scored the copy of the step's start"
    assert engine.policy_version == 1
