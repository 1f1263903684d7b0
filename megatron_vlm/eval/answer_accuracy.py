"""Held-out answer accuracy of an SFT run: greedy answers generated with the rollout engine
(`PolicyRolloutEngine`, the one decoder of the code base) compared with the reference answers.

The eval loader yields left-padded prompt batches (the last assistant turn dropped), the same number
on every rank (filler rows, `sample_valid` False, even out the ranks). Each batch is one engine call
with temperature 0 (greedy); decoding stops at the tokenizer's / generation config's EOS tokens (the
engine's rule) or after `max_new_tokens`, and the engine keeps the ranks in lock-step. Answers are
compared on their first word (`eval.answers`), overall and per record group (`meta.question_type`).

`generate_answers` is the generation half, shared with the benchmark evaluation of
`launch/evaluate.py` (eval/benchmark_eval.py), so a model scores the same there as here: the same
loader, batches, engine settings and decoding of the completions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.data.loader import build_eval_dataloader
from megatron_vlm.eval.answers import AnswerTally
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.parallel.collectives import any_rank
from megatron_vlm.parallel.precision import compute_dtype
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["answer_engine", "batch_prompts", "GeneratedAnswers", "completion_text", "generate_answers", "answer_loader",
           "answer_accuracy"]


def answer_engine(ctx: RunContext, bundle: ModelBundle) -> PolicyRolloutEngine:
    """The engine for answer accuracy: the policy through the FSDP root, whole batches in one
    prefill (one lock-step batch), the loader's pad id and no suppressed tokens — the plain greedy
    decoding of the batch. Its KV cache holds the compute dtype (bf16 under bf16 precision), as the
    training forward's keys / values."""
    cache_dtype = compute_dtype(ctx.cfg.train.precision, getattr(torch, ctx.cfg.model.dtype), ctx.device)
    return PolicyRolloutEngine(bundle.model, bundle.processor.tokenizer,
                               EngineOptions(cache_dtype=cache_dtype, pad_token_id=bundle.processor.pad_token_id,
                                             device=ctx.device, max_prompts_per_batch=0, suppress_token_ids=()),
                               forward=lambda **kw: bundle.wrapper(model_kwargs=kw),
                               all_ranks_active=lambda active: any_rank(active, ctx.device))


def batch_prompts(batch: dict) -> list[RolloutPrompt]:
    """A left-padded loader batch as engine prompts: each row without its padding. The batch's vision
    tensors (concatenated over its rows in order, the batched-input layout) ride on the first prompt:
    the engine concatenates the vision inputs of one call's prompts in order, so its prefill gets
    exactly the batch's tensors. Valid only for an engine that prefills all prompts of a call together
    (`max_prompts_per_batch=0`) once, sharing the prefix over the n samples (`share_prefix`, the default).
    A batch whose rows' vision tensors cannot be concatenated (`row_vision`: Nemotron-VL videos of two tile sizes)
    gives each prompt its own: the engine then prefills the rows of each tile size apart."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if "row_vision" in batch:
        return [RolloutPrompt(input_ids=ids[r][mask[r]], **batch["row_vision"][r]) for r in range(ids.shape[0])]
    vision = {k: batch[k] for k in VISION_KEYS if batch.get(k) is not None}
    return [RolloutPrompt(input_ids=ids[r][mask[r]], **(vision if r == 0 else {})) for r in range(ids.shape[0])]


def _answer_ids(token_ids: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    out = token_ids.tolist()
    return out[:-1] if out and out[-1] in eos_ids else out


@dataclass
class GeneratedAnswers:
    """The completions of one valid prompt row of this rank."""

    index: int
    """The row's index in its record source (file order)."""
    reference: str
    """The reference answer (the record's last assistant turn)."""
    meta: dict
    """The record's metadata (question_type, verifier, choices, ...)."""
    completions: list[str]
    """The n completions, decoded without the EOS token (cut after a stop string)."""


def completion_text(tokenizer, sample, eos_ids: Sequence[int]) -> str:
    if sample.finish_reason == "stop":
        return sample.text
    return tokenizer.decode(_answer_ids(sample.token_ids, eos_ids), skip_special_tokens=True)


@torch.no_grad()
def generate_answers(bundle: ModelBundle, engine: PolicyRolloutEngine, loader, params: SamplingParams, *,
                     generator: Optional[torch.Generator] = None,
                     progress: Optional[Callable[[int, int], None]] = None) -> list[GeneratedAnswers]:
    """`params.n` completions for every valid row of the left-padded generation `loader` (one engine
    call per batch, the ranks in lock-step), in loader order. `progress(done, total)` after each batch."""
    tok = bundle.processor.tokenizer
    n = params.n
    out: list[GeneratedAnswers] = []
    bundle.wrapper.eval()
    try:
        for b, batch in enumerate(loader):
            result = engine.generate(batch_prompts(batch), params, generator=generator)
            rows = len(batch["answers"])
            metas = batch.get("meta") or [{}] * rows
            indices = batch["sample_index"].tolist() if "sample_index" in batch else [0] * rows
            for r, (ok, ref, meta, index) in enumerate(zip(batch["sample_valid"].tolist(), batch["answers"], metas, indices)):
                if ok and ref is not None:
                    texts = [completion_text(tok, s, engine.eos_token_ids) for s in result.samples[r * n:(r + 1) * n]]
                    out.append(GeneratedAnswers(index, ref, meta, texts))
            if progress is not None:
                progress(b + 1, len(loader))
    finally:
        engine.release_memory()
        bundle.wrapper.train()
    return out


def answer_loader(ctx: RunContext, bundle: ModelBundle, *, bad_records=None, batch_size: int = 16):
    """The eval split's left-padded prompt batches for this rank, or None without an eval split. Building it
    estimates every prompt's length and logs the records it skips: build it once per run and pass it to each
    `answer_accuracy` (a loader is iterated afresh by every call)."""
    return build_eval_dataloader(ctx.cfg.data, bundle.processor, dp_rank=getattr(bundle.dims, "dp_rank", ctx.env.rank),
                                 dp_size=bundle.dims.dp_size,
                                 mode="generation", batch_size=batch_size, padding_side="left", bad_records=bad_records)


@torch.no_grad()
def answer_accuracy(ctx: RunContext, bundle: ModelBundle, engine: PolicyRolloutEngine, *, bad_records=None,
                    max_new_tokens: int = 6, batch_size: int = 16, group_field: str = "question_type",
                    loader=None) -> Optional[dict]:
    """`answer_accuracy`, `answer_n` and `answer_accuracy/<group>` over the eval split (all ranks),
    or None without an eval split or answers. `loader`: the split's `answer_loader` (built here when not given)."""
    if loader is None:
        loader = answer_loader(ctx, bundle, bad_records=bad_records, batch_size=batch_size)
    if loader is None:
        return None
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    tally = AnswerTally(group_field)
    for row in generate_answers(bundle, engine, loader, params):
        tally.add(row.completions[0], row.reference, row.meta, index=row.index)
    copies = getattr(bundle.dims, "tp", 1) * getattr(bundle.dims, "cp", 1)  # pp: no held-out eval (refused)
    return tally.merged(copies=copies).metrics()
