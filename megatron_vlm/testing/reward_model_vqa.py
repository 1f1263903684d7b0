"""Correct vs wrong answers of the synthetic VQA task for reward models (tests and benchmarks).

Why: `[[rl.rewards]] type = "model"` has to be shown to carry the task's signal, with no checker in the
loop: a sequence-classification model (a VLM folder's backbone with a scalar head, rl/rewards/score_model.py)
learns from (image, question, answer) pairs — the right answer and a wrong one per question (of the same
question type three times in four, any answer word otherwise; optionally an answer with extra words after it).
`write_preference_jsonl` writes them as the preference data `[train] mode = "reward"` trains on (the
Bradley-Terry loss, training/reward/); `score_model_from_causal` gives a scalar-head model to tests directly.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from megatron_vlm.data.synthetic_vqa import ANSWERS

__all__ = ["vqa_pairs", "score_model_from_causal", "write_preference_jsonl"]

_ALL_ANSWERS = sorted({a for v in ANSWERS.values() for a in v})


def vqa_pairs(jsonl: str | Path, *, seed: int = 0, limit: int = 0, malformed: float = 0.0) -> list[tuple[list[dict], str, str]]:
    """(prompt messages with absolute image paths, correct answer, wrong answer) per record of a synthetic split.
    With probability `malformed` the wrong answer is an answer (right or wrong) followed by 1-3 more answer
    words: a reward model never shown such completions may score them high, and GRPO then learns to write
    them (measured: megatron_vlm/rl/README.md, "GRPO with a learned reward model")."""
    path = Path(jsonl)
    rng = random.Random(seed)
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        msgs = [m for m in rec["messages"] if m["role"] != "assistant"]
        for m in msgs:
            if isinstance(m["content"], list):
                for it in m["content"]:
                    if it.get("type") == "image" and not Path(it["image"]).is_absolute():
                        it["image"] = str(path.parent / it["image"])
        right = rec["answer"]
        pool = ANSWERS[rec["question_type"]] if rng.random() < 0.75 else _ALL_ANSWERS
        wrong = rng.choice([a for a in pool if a != right])
        if malformed and rng.random() < malformed:  # what a policy drifts to: the answer with more words after it
            extra = " ".join(rng.choice(_ALL_ANSWERS) for _ in range(rng.randint(1, 3)))
            wrong = f"{rng.choice([right, wrong])} {extra}"
        out.append((msgs, right, wrong))
        if limit and len(out) >= limit:
            break
    return out


def score_model_from_causal(folder: str | Path, *, seed: int = 0) -> Any:
    """A `SequenceScoreModel` on the backbone of the causal model folder `folder` (float32, CPU), a fresh head
    (N(0, 0.02) weights, one label)."""
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.rl.rewards.score_model import SequenceScoreModel
    from megatron_vlm.training.reward.model import NoLMHead

    backbone = load_hf_model(folder, dtype=torch.float32, device="cpu")
    hidden = backbone.lm_head.in_features
    backbone.lm_head = NoLMHead(backbone.lm_head.weight.dtype)
    model = SequenceScoreModel(backbone, hidden, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * 0.02)
    return model


def write_preference_jsonl(pairs: list[tuple[list[dict], str, str]], path: str | Path) -> Path:
    """`pairs` (from `vqa_pairs`) as a preference JSON-lines file (`{"messages": prompt turns, "chosen": the right
    answer, "rejected": the wrong one}`, data/preference_records.py), the data of `[train] mode = "reward"`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for msgs, right, wrong in pairs:
            f.write(json.dumps({"messages": msgs, "chosen": right, "rejected": wrong}) + "\n")
    return path
