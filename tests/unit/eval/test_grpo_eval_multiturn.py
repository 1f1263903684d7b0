"""The GRPO held-out evaluation of an [rl.env] run holds the conversations training holds: the model calls its tool,
reads the reply and answers, and the verifiers score that answer (the last model turn), as the rollout's reward
does. It used to decode one single-turn completion per prompt (the tool specs in the system turn, no environment),
so the accuracy scored the model's tool call, not its answer: a tool-trained model measured ~0 without a word."""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from megatron_vlm.eval.grpo_accuracy import GRPOEvaluator
from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.rl.prompts.dataset import PromptDataset, PromptSample

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def _sample(p: int, j: int, text: str) -> RolloutSample:
    return RolloutSample(prompt_index=p, sample_index=j, token_ids=torch.tensor([1, 2]), logprobs=torch.zeros(2),
                         text=text, finish_reason="eos", prompt_length=3)


class _Engine:
    """Single-turn decoding: the tool-trained model's first turn is its call."""

    def generate(self, prompts, params, generator=None):  # noqa: ARG002
        return RolloutResult(samples=[_sample(p, j, CALL) for p in range(len(prompts)) for j in range(params.n)])

    def release_memory(self):
        pass


class _MultiTurn:
    """The environment loop: after the tool's reply the model answers 42."""

    def __init__(self):
        self.seeds: list[int] = []

    def generate(self, shard, params, seed):
        self.seeds.append(seed)
        n = shard.num_real
        return RolloutResult(samples=[_sample(p, j, "42") for p in range(n) for j in range(params.n)]), []


class _Encoder:
    skipped = 0

    def encode(self, s: PromptSample):
        return RolloutPrompt(input_ids=torch.tensor([5, 6, 7]))


class _Manager:
    def __init__(self):
        self.texts: list[str] = []

    def score(self, texts, answers, prompts, metas, only):  # noqa: ARG002
        self.texts += list(texts)
        return NS(per_reward={only[0]: [float(t == a) for t, a in zip(texts, answers)]})


def test_held_out_evaluation_runs_the_environment():
    ctx = NS(env=NS(rank=0, world_size=1, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    rl = NS(eval=NS(max_prompts=0, max_new_tokens=8, k=2, temperature=1.0, top_p=1.0, correct_threshold=1.0),
            rollout=NS(max_new_tokens=8, stop=[]), accuracy_label=lambda: "acc")
    samples = [PromptSample(f"p{i}", [], "42", f"6 * 7 = ? ({i})", source="held.jsonl", index=i) for i in range(3)]
    manager, mt = _Manager(), _MultiTurn()
    wrapper = NS(eval=lambda: None, train=lambda: None)
    evaluate = GRPOEvaluator(ctx, wrapper, rl, _Engine(), _Encoder(), manager, PromptDataset(samples, "messages"),
                             multiturn=mt)
    metrics = evaluate(1)
    assert manager.texts == ["42"] * 6, "the held-out evaluation scored the first (tool-call) turn"
    assert metrics is not None and metrics["accuracy"] == 1.0 and metrics["num_prompts"] == 3
    evaluate(2)
    assert len(set(mt.seeds)) == 2  # each evaluation draws its own conversations


class _FailingEnv:
    """Every conversation answers 42 (1 by the verifier; its environment paid 1.0 on the first turn), and the
    environment of conversation 1 (prompt 0, sample 1) failed after that turn (env_error)."""

    def __init__(self):
        self.trajs: list = []

    def generate(self, shard, params, seed):  # noqa: ARG002
        n = shard.num_real * params.n
        self.trajs = [NS(finish_reason="env_error" if i == 1 else "done", turn_rewards=[1.0]) for i in range(n)]
        return RolloutResult(samples=[_sample(i // params.n, i % params.n, "42") for i in range(n)]), self.trajs

    def rewards(self, trajs):
        return [sum(t.turn_rewards) for t in trajs]


def test_a_conversation_whose_environment_failed_scores_0_and_is_counted():
    """As training leaves such a conversation out and the tool demos' evaluation scores it 0 (rl/env/demo_eval.py):
    its last turn or partial return says nothing of the model. Hand-derived: prompt 0 scores (1 + 0) / 2, prompt 1
    (1 + 1) / 2, Avg@2 = 0.75; one error."""
    ctx = NS(env=NS(rank=0, world_size=1, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    samples = [PromptSample(f"p{i}", [], "42", "6 * 7 = ?", source="held.jsonl", index=i) for i in range(2)]
    wrapper = NS(eval=lambda: None, train=lambda: None)
    for label in ("acc", "env"):
        rl = NS(eval=NS(max_prompts=0, max_new_tokens=8, k=2, temperature=1.0, top_p=1.0, correct_threshold=1.0),
                rollout=NS(max_new_tokens=8, stop=[]), accuracy_label=lambda label=label: label)
        manager = _Manager()
        metrics = GRPOEvaluator(ctx, wrapper, rl, _Engine(), _Encoder(), manager, PromptDataset(samples, "messages"),
                                multiturn=_FailingEnv())(1)
        assert metrics is not None and metrics["accuracy"] == 0.75 and metrics["env_errors"] == 1.0, (label, metrics)
        assert metrics["pass@2"] == 1.0 and metrics["num_prompts"] == 2
