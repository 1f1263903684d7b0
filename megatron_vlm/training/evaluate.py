"""Periodic evaluation: held-out loss / perplexity over the eval split and, for data whose last
assistant turn is a short answer, greedy-decoded answer accuracy (exact match after normalising
case and surrounding punctuation).

Every rank runs the same number of forward calls (FSDP all-gathers are collective): shards are
padded with repeats whose results are not counted.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("megatron_vlm")


def _sum(vals, device):
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _max_int(v: int, device) -> int:
    t = torch.tensor([v], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@torch.no_grad()
def eval_loss(job) -> dict | None:
    from megatron_vlm.data.loader import build_eval_dataloader

    loader = build_eval_dataloader(job.cfg.data, job.processor, dp_rank=job.env.rank, dp_size=job.dims.dp_size,
                                   bad_records=job.bad_records)
    if loader is None:
        return None
    packs = list(loader)
    cap = job.cfg.train.eval_max_batches
    if cap:
        packs = packs[:cap]
    n = _max_int(len(packs), job.env.device)
    if n == 0:
        return None
    nll = tok = 0.0
    job.wrapper.eval()
    for i in range(n):
        real = i < len(packs)
        b = job.to_device(packs[i] if real else packs[-1] if packs else None) if (real or packs) else None
        if b is None:  # this rank has no eval data at all: cannot join the collective forward
            raise RuntimeError("evaluation: a rank received no eval packs; use fewer processes or more eval data")
        logp = job.wrapper(b)
        if real:
            nll += float(-logp.double().sum())
            tok += float(logp.numel())
    job.wrapper.train()
    nll, tok = _sum([nll, tok], job.env.device)
    loss = nll / max(tok, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tok}


def _normalise(text: str) -> str:
    return text.strip().strip(".!?,;:\"'").strip().lower()


def load_qa_prompts(jsonl_path: Path, image_root: str = "") -> list[dict]:
    """Records whose last message is an assistant answer -> {"messages": prompt turns, "answer": str}."""
    out = []
    root = Path(image_root) if image_root else jsonl_path.parent
    with jsonl_path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                msgs = rec["messages"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if not msgs or msgs[-1].get("role") != "assistant" or not isinstance(msgs[-1].get("content"), str):
                continue
            prompt = []
            for m in msgs[:-1]:
                content = m["content"]
                if isinstance(content, list):
                    fixed = []
                    for c in content:
                        c = dict(c)
                        if c.get("type") == "image" and isinstance(c.get("image"), str) and not Path(c["image"]).is_absolute():
                            c["image"] = str(root / c["image"])
                        fixed.append(c)
                    content = fixed
                prompt.append({"role": m["role"], "content": content})
            out.append({"messages": prompt, "answer": msgs[-1]["content"]})
    return out


@torch.no_grad()
def greedy_generate(job, prompts: list[dict], max_new_tokens: int) -> list[str]:
    """Batched greedy decoding without a KV cache (short answers); left padding."""
    from PIL import Image

    proc = job.processor
    tok = proc.tokenizer
    texts, images = [], []
    for p in prompts:
        texts.append(proc.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True))
        for m in p["messages"]:
            if isinstance(m["content"], list):
                for c in m["content"]:
                    if c.get("type") == "image":
                        images.append(Image.open(c["image"]).convert("RGB"))
    old_side = tok.padding_side
    tok.padding_side = "left"
    enc = proc(text=texts, images=images or None, return_tensors="pt", padding=True)
    tok.padding_side = old_side
    ids, am = enc["input_ids"], enc["attention_mask"]
    extra = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    gen = []
    for _ in range(max_new_tokens):
        kwargs = job.to_device({"input_ids": ids, "attention_mask": am, **extra})
        logits = job.wrapper(model_kwargs=kwargs)
        nxt = logits[:, -1].argmax(-1).cpu()
        gen.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)
        am = torch.cat([am, torch.ones_like(nxt)[:, None]], 1)
    out = []
    g = torch.stack(gen, 1) if gen else torch.zeros(len(prompts), 0, dtype=torch.long)
    for row in g.tolist():
        cut = [t for t in row]
        for i, t in enumerate(row):
            if t in eos:
                cut = row[:i]
                break
        out.append(tok.decode(cut, skip_special_tokens=True))
    return out


@torch.no_grad()
def eval_answer_accuracy(job, *, max_new_tokens: int = 8, batch_size: int = 16) -> dict | None:
    path = getattr(job, "eval_jsonl", None)
    if path is None or not Path(path).is_file():
        return None
    prompts = load_qa_prompts(Path(path), job.cfg.data.image_root)
    if not prompts:
        return None
    world, rank = job.dims.dp_size, job.env.rank
    mine = prompts[rank::world]
    n_batches = _max_int(math.ceil(len(mine) / batch_size), job.env.device)
    correct = total = 0
    job.wrapper.eval()
    for bi in range(n_batches):
        chunk = mine[bi * batch_size:(bi + 1) * batch_size]
        real = len(chunk)
        if real == 0:
            chunk = mine[:1] or prompts[:1]
        outs = greedy_generate(job, chunk, max_new_tokens)
        for p, o in zip(chunk[:real], outs[:real]):
            total += 1
            correct += int(_normalise(o) == _normalise(p["answer"]))
    job.wrapper.train()
    correct, total = _sum([correct, total], job.env.device)
    return {"answer_accuracy": correct / max(total, 1), "answer_n": total}


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
