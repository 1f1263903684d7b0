"""`evaluate_benchmark` in-process without a model: the tiny Qwen2.5-VL processor and the real eval loader, with
an engine stand-in that answers every prompt with a fixed text (the rollout engine's tests cover decoding; these
tests are about what the evaluation counts)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Optional

import torch
from PIL import Image

from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.data.config import DataConfig
from megatron_vlm.inference.engine import RolloutResult, RolloutSample


class AnswerEngine:
    """Every completion is `text`."""

    eos_token_ids = (0,)

    def __init__(self, text: str = "red"):
        self.text, self.calls = text, 0

    def release_memory(self):
        pass

    def generate(self, prompts, params, generator=None):
        self.calls += 1
        return RolloutResult(samples=[RolloutSample(prompt_index=p, sample_index=j, token_ids=torch.tensor([1]),
                                                    logprobs=torch.zeros(1), text=self.text, finish_reason="stop",
                                                    prompt_length=int(prompts[p].input_ids.numel()))
                                      for p in range(len(prompts)) for j in range(params.n)])


def write_png(path: Path, *, truncated: bool = False) -> Path:
    """A 56 x 56 PNG; `truncated`: its header reads (the planning pass estimates its length) but its pixels do
    not decode (the row fails when the loader processes it)."""
    Image.new("RGB", (56, 56), (200, 30, 30)).save(path)
    if truncated:
        path.write_bytes(path.read_bytes()[:60])
    return path


def write_messages(path: Path, rows: list[tuple[Optional[str], str, str]]) -> Path:
    """A messages JSONL benchmark: (image file name or None, question, answer) per row."""
    lines = []
    for image, q, a in rows:
        content = ([{"type": "image", "image": image}] if image else []) + [{"type": "text", "text": q}]
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": a}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def evaluate(proc, bench: BenchmarkConfig, *, engine=None, rank: int = 0, world: int = 1, **eval_kw) -> dict:
    """The results of one benchmark (`evaluate_benchmark`) on this rank of `world` data-parallel ranks."""
    from megatron_vlm.eval.benchmark_eval import VerifierScorer, evaluate_benchmark

    ecfg = EvalConfig(benchmarks=[bench], **{"max_new_tokens": 4, "batch_size": 2, "reward_workers": 1, **eval_kw})
    cfg = NS(eval=ecfg, data=DataConfig(max_tokens_per_pack=512, num_workers=0), train=NS(seed=0))
    ctx = NS(cfg=cfg, env=NS(rank=rank, world_size=world, is_main=rank == 0, device=torch.device("cpu")))
    bundle = NS(processor=proc, dims=NS(dp_rank=rank, dp_size=world), wrapper=NS(eval=lambda: None, train=lambda: None))
    scorer = VerifierScorer(ecfg)
    try:
        return evaluate_benchmark(ctx, bundle, engine or AnswerEngine(), bench, scorer)
    finally:
        scorer.close()
