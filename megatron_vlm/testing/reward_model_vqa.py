"""A small reward model trained on the synthetic VQA task's correct vs wrong answers (tests and benchmarks).

Why: `[[rl.rewards]] type = "model"` has to be shown to carry the task's signal, with no checker in the
loop: a sequence-classification model (a VLM folder's backbone with a scalar head, rl/rewards/score_model.py)
learns from (image, question, answer) pairs labelled correct / wrong — the right answer and a wrong one per
question (of the same question type three times in four, any answer word otherwise; optionally an answer
with extra words after it) — with a binary
cross-entropy on its logit; its sigmoid is then the reward (`activation = "sigmoid"`). As in the demo, the
random vision tower stays frozen and the patch merger, the language model and the head train.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_vlm.data.messages import Record
from megatron_vlm.data.synthetic_vqa import ANSWERS

__all__ = ["vqa_pairs", "score_model_from_causal", "train_vqa_reward_model", "pair_accuracy"]

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
    from torch import nn

    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.rl.rewards.score_model import SequenceScoreModel

    backbone = load_hf_model(folder, dtype=torch.float32, device="cpu")
    hidden = backbone.lm_head.in_features
    backbone.lm_head = nn.Identity()
    model = SequenceScoreModel(backbone, hidden, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * 0.02)
    return model


def _encode(processor: Any, msgs: list[dict], answer: str) -> Any:
    from megatron_vlm.data.processing import process_record

    return process_record(Record(msgs + [{"role": "assistant", "content": answer}], "vqa_pairs", -1), processor,
                          max_frames=1)


@torch.no_grad()
def pair_accuracy(model: Any, processor: Any, pairs: list[tuple[list[dict], str, str]], *, batch: int = 32) -> float:
    """Share of pairs whose correct answer the model scores above the wrong one."""
    from megatron_vlm.data.packing import collate_pack

    model.eval()
    wins = 0
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        samples = [_encode(processor, m, a) for m, r, w in chunk for a in (r, w)]
        logits = model(collate_pack(samples))[:, 0]
        wins += int((logits[0::2] > logits[1::2]).sum())
    return wins / max(len(pairs), 1)


def train_vqa_reward_model(model: Any, processor: Any, pairs: list[tuple[list[dict], str, str]], *, steps: int,
                           batch_prompts: int = 16, lr: float = 3e-4, seed: int = 0,
                           log: Optional[Callable[[int, float], None]] = None) -> list[float]:
    """Train `model` (a `SequenceScoreModel`) in place with a binary cross-entropy: each step takes `batch_prompts`
    pairs (their correct answers labelled 1, wrong 0); returns the loss per step. The vision tower stays frozen."""
    from megatron_vlm.data.packing import collate_pack

    rng = random.Random(seed)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("backbone.visual.") or name.startswith("backbone.visual.merger."))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = list(range(len(pairs)))
    losses = []
    model.train()
    for step in range(steps):
        idx = [order[(step * batch_prompts + j) % len(order)] for j in range(batch_prompts)]
        if (step * batch_prompts) % len(order) < batch_prompts:
            rng.shuffle(order)
        samples, labels = [], []
        for i in idx:
            msgs, right, wrong = pairs[i]
            samples += [_encode(processor, msgs, right), _encode(processor, msgs, wrong)]
            labels += [1.0, 0.0]
        logits = model(collate_pack(samples))[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, torch.tensor(labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None:
            log(step, losses[-1])
    model.eval()
    return losses
