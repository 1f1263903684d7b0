"""Periodic evaluation: held-out loss / perplexity over the eval split and, for data whose last
assistant turn is a short answer, greedy-decoded answer accuracy (first word, case and punctuation
folded — `synthetic_vqa.normalize_answer`).

Every rank runs the same number of forward calls (FSDP all-gathers are collective): the eval
loaders pad the ranks with empty packs / filler prompts, which run a forward but are not counted.
"""
from __future__ import annotations

import logging
import math

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.parallel.collectives import all_reduce_sum

log = logging.getLogger("megatron_vlm")


def _dummy_pack(pad_id: int) -> dict:
    return {"input_ids": torch.tensor([[pad_id]]), "labels": torch.tensor([[-100]]),
            "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32), "num_samples": 0}


@torch.no_grad()
def eval_loss(job) -> dict | None:
    from megatron_vlm.data.loader import build_eval_dataloader

    loader = build_eval_dataloader(job.cfg.data, job.processor, dp_rank=job.env.rank, dp_size=job.dims.dp_size,
                                   mode="packs", bad_records=job.bad_records)
    if loader is None:
        return None
    cap = job.cfg.train.eval_max_batches
    nll = tok = 0.0
    job.wrapper.eval()
    for i, pack in enumerate(loader):
        if cap and i >= cap:
            break
        real = int(pack.get("num_samples", 1)) > 0
        b = job.to_device(pack if real else _dummy_pack(job.processor.pad_token_id))
        logp = job.wrapper(b)
        if real:
            nll += float(-logp.double().sum())
            tok += float(logp.numel())
    job.wrapper.train()
    nll, tok = all_reduce_sum([nll, tok], job.env.device)
    if tok == 0:
        return None
    loss = nll / tok
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tok}


@torch.no_grad()
def greedy_decode(job, batch: dict, max_new_tokens: int, stop_ids: set[int]) -> list[list[int]]:
    """Greedy decoding with the model's KV cache through the FSDP root (left-padded prompts)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    bsz = ids.shape[0]
    # attention-only families: KVCache; hybrid Mamba families (Nemotron-H): KV + conv/SSM state
    make = getattr(job.model, "new_kv_cache", None) or getattr(job.model, "make_cache")
    cache = make(bsz, ids.shape[1] + max_new_tokens, device=job.env.device)
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", *VISION_KEYS) if batch.get(k) is not None}
    logits = job.wrapper(model_kwargs={**job.to_device(kwargs), "kv_cache": cache})
    out = [[] for _ in range(bsz)]
    done = torch.zeros(bsz, dtype=torch.bool)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1).cpu()
        for i in range(bsz):
            if not done[i]:
                t = int(nxt[i])
                if t in stop_ids:
                    done[i] = True
                else:
                    out[i].append(t)
        # all ranks decode the same number of steps (collective forwards), even when done
        logits = job.wrapper(model_kwargs={"input_ids": nxt[:, None].to(job.env.device), "kv_cache": cache})
    return out


@torch.no_grad()
def eval_answer_accuracy(job, *, max_new_tokens: int = 6, batch_size: int = 16) -> dict | None:
    from megatron_vlm.data.loader import build_eval_dataloader
    from megatron_vlm.data.synthetic_vqa import QUESTION_TYPES, normalize_answer

    loader = build_eval_dataloader(job.cfg.data, job.processor, dp_rank=job.env.rank, dp_size=job.dims.dp_size,
                                   mode="generation", batch_size=batch_size, padding_side="left",
                                   bad_records=job.bad_records)
    if loader is None:
        return None
    tok = job.processor.tokenizer
    stop = {i for i in (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id) if i is not None}
    correct = total = 0
    # hits and counts per "question_type" of the record (synthetic VQA): which skill was learned, not
    # just how much. A fixed list of types, so every rank all-reduces a vector of the same length
    # (ranks may see different types); other values count only in the total.
    type_index = {q: i for i, q in enumerate(QUESTION_TYPES)}
    per_type = [0] * (2 * len(QUESTION_TYPES))
    job.wrapper.eval()
    for batch in loader:
        gen = greedy_decode(job, batch, max_new_tokens, stop)
        metas = batch.get("meta") or [{}] * len(gen)
        for ok, ref, g, meta in zip(batch["sample_valid"].tolist(), batch["answers"], gen, metas):
            if ok and ref is not None:
                hit = int(normalize_answer(tok.decode(g, skip_special_tokens=True)) == normalize_answer(ref))
                total += 1
                correct += hit
                qtype = (meta or {}).get("question_type")
                i = type_index.get(qtype) if isinstance(qtype, str) else None
                if i is not None:
                    per_type[2 * i] += hit
                    per_type[2 * i + 1] += 1
    job.wrapper.train()
    correct, total, *per_type = all_reduce_sum([correct, total, *per_type], job.env.device)
    if total == 0:
        return None
    out = {"answer_accuracy": correct / total, "answer_n": total}
    for i, q in enumerate(QUESTION_TYPES):
        c, n = per_type[2 * i], per_type[2 * i + 1]
        if n > 0:
            out[f"answer_accuracy/{q}"] = c / n
    return out


def evaluate(job, step: int) -> dict:
    metrics = {}
    el = eval_loss(job)
    if el:
        metrics.update(el)
    if job.cfg.train.eval_generate:
        acc = eval_answer_accuracy(job)
        if acc:
            metrics.update(acc)
    if metrics:
        job.metrics.log("eval", step, metrics)
    job.last_eval = metrics
    return metrics
