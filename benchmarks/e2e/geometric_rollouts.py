"""The shared set-up of the rollout-scheduling benchmarks (bench_paged_pool.py, bench_lockstep_refill.py).

Random-weights models of the rollout rows (the 3B shape on a GPU, `cpu_config` on the CPU, `tiny_config` with
--quick), image prompts, and completion lengths made geometric by an end-of-sequence set of a share of the
vocabulary (mean ~1 / eos_frac tokens, cut at the budget); the tokens/s of two schedules timed in interleaved
rounds and their ratio per round.
"""
from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch
from bench_rollout import cpu_config, make_prompts, positive_int, qwen2_5_vl_3b_config, tiny_config

from megatron_vlm.models import build_model

__all__ = ["add_common_args", "build_setup", "rates", "ratio"]


def add_common_args(ap: argparse.ArgumentParser, *, group: int, new_tokens: int, eos_frac: float) -> None:
    """The arguments both benchmarks take (their own defaults)."""
    ap.add_argument("--quick", action="store_true", help="tiny model and prompts on the CPU (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="the CPU row even when a GPU is present")
    ap.add_argument("--prompts", type=positive_int, default=8)
    ap.add_argument("--group", type=positive_int, default=group)
    ap.add_argument("--new-tokens", type=positive_int, default=new_tokens)
    ap.add_argument("--eos-frac", type=float, default=eos_frac, help="share of the vocabulary that ends a completion")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--json", type=str, default=None)


def build_setup(args) -> SimpleNamespace:
    """device, gpu, model (eval), prompts and the end-of-sequence ids of `args`."""
    device = "cuda" if torch.cuda.is_available() and not (args.cpu or args.quick) else "cpu"
    gpu = device == "cuda"
    if args.quick:
        cfg, grid, text = tiny_config(), (1, 4, 4), 10
    else:
        cfg, grid, text = (qwen2_5_vl_3b_config(), (1, 32, 32), 100) if gpu else (cpu_config(), (1, 8, 8), 40)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16 if gpu else torch.float32, device=device).eval()
    prompts = make_prompts(args.prompts, grid, text, cfg, seed=1)
    vocab = min(cfg["text_config"]["vocab_size"],  # plain text ids only: the vision ids are never sampled
                *(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")))
    g = torch.Generator().manual_seed(5)
    eos = torch.randperm(vocab, generator=g)[: max(1, int(args.eos_frac * vocab))].tolist()
    return SimpleNamespace(device=device, gpu=gpu, model=model, prompts=prompts, eos=eos,
                           device_name=torch.cuda.get_device_name() if gpu else "cpu")


def rates(tokens: list[int], seconds: list[float]) -> dict:
    """tokens/s median and min of the timed rounds."""
    tps = [t / s for t, s in zip(tokens, seconds)]
    return {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "seconds": seconds,
            "tokens": tokens}


def ratio(ours: dict, base: dict) -> dict:
    """Per-round ratio of `ours`' tokens/s to `base`'s (`rates` outputs), median and min."""
    per = [(t / s) / (bt / bs) for t, s, bt, bs in zip(ours["tokens"], ours["seconds"], base["tokens"], base["seconds"])]
    return {"ratio_median": statistics.median(per), "ratio_min": min(per)}
