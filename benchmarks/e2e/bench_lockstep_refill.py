"""Lock-stepped rollouts (rl.rollout.weights = "shared" / "expert_parallel"): slots refilled vs chunked batches.

The lock-step engine decodes `--batch-prompts` prompts' samples at once. Chunked batches (what it did before
its slots were refilled) run one batch after the other, each until its longest completion ends; refilled, a
slot takes the next waiting sample as soon as its completion ends. The baseline is the same engine called once
per chunk of `--batch-prompts` prompts (the chunked schedule exactly: each call decodes until its longest
completion ends); the other run is one call over all prompts. Completion lengths are geometric (an end-of-
sequence set of `--eos-frac` of the vocabulary on random weights), sampling at temperature 1, one process with
the lock-step form (`all_ranks_active` = the local flag, the trainer-forward call), interleaved rounds after a
warm-up each; reported: tokens/s min / median, the ratio, and decode steps per call.

    python benchmarks/e2e/bench_lockstep_refill.py            # CPU (small Qwen2.5-VL layout); GPU when present
    python benchmarks/e2e/bench_lockstep_refill.py --quick    # smoke test (tiny model)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import (  # noqa: E402
    NoDecode,
    cpu_config,
    interleaved,
    make_prompts,
    positive_int,
    qwen2_5_vl_3b_config,
    tiny_config,
)

from megatron_vlm.inference.engine import SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models import build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and prompts on the CPU (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="the CPU row even when a GPU is present")
    ap.add_argument("--prompts", type=positive_int, default=8)
    ap.add_argument("--group", type=positive_int, default=4)
    ap.add_argument("--batch-prompts", type=positive_int, default=2, help="prompts whose samples decode at once")
    ap.add_argument("--new-tokens", type=positive_int, default=128)
    ap.add_argument("--eos-frac", type=float, default=0.02, help="share of the vocabulary that ends a completion")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not (args.cpu or args.quick) else "cpu"
    gpu = device == "cuda"
    if args.quick:
        cfg, grid, text = tiny_config(), (1, 4, 4), 10
    else:
        cfg, grid, text = (qwen2_5_vl_3b_config(), (1, 32, 32), 100) if gpu else (cpu_config(), (1, 8, 8), 40)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16 if gpu else torch.float32, device=device).eval()
    prompts = make_prompts(args.prompts, grid, text, cfg, seed=1)
    vocab = min(cfg["text_config"]["vocab_size"],
                *(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")))
    g = torch.Generator().manual_seed(5)
    eos = torch.randperm(vocab, generator=g)[: max(1, int(args.eos_frac * vocab))].tolist()
    engine = PolicyRolloutEngine(model, NoDecode(), EngineOptions(eos_token_ids=eos, device=device,
                                                                  max_prompts_per_batch=args.batch_prompts),
                                 forward=lambda **kw: model(**kw), all_ranks_active=lambda active: active)
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.group, temperature=1.0)
    chunks = [prompts[i:i + args.batch_prompts] for i in range(0, len(prompts), args.batch_prompts)]
    tokens: dict[str, list[int]] = {"chunked": [], "refilled": []}
    steps: dict[str, list[float]] = {"chunked": [], "refilled": []}

    def chunked():
        gen = torch.Generator(device).manual_seed(3)
        results = [engine.generate(c, params, generator=gen) for c in chunks]
        tokens["chunked"].append(sum(r.num_generated_tokens for r in results))
        steps["chunked"].append(sum(r.stats["decode_steps"] for r in results))

    def refilled():
        r = engine.generate(prompts, params, generator=torch.Generator(device).manual_seed(3))
        tokens["refilled"].append(r.num_generated_tokens)
        steps["refilled"].append(r.stats["decode_steps"])

    times = interleaved({"chunked": chunked, "refilled": refilled}, device, args.repeats)
    out = {}
    for name in ("chunked", "refilled"):
        tps = [t / s for t, s in zip(tokens[name][1:], times[name])]  # the warm-up call is not timed
        out[name] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "seconds": times[name],
                     "tokens": tokens[name][1:], "decode_steps": steps[name][1:]}
    ratio = [r / c for r, c in zip((t / s for t, s in zip(out["refilled"]["tokens"], times["refilled"])),
                                   (t / s for t, s in zip(out["chunked"]["tokens"], times["chunked"])))]
    summary = {"ratio_median": statistics.median(ratio), "ratio_min": min(ratio), "runs": out}
    meta = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__, "prompts": args.prompts,
            "group": args.group, "batch_prompts": args.batch_prompts, "new_tokens": args.new_tokens,
            "eos_frac": args.eos_frac, "quick": args.quick, "date": time.strftime("%Y-%m-%d")}
    for name, v in out.items():
        print(f"{name:9s} {v['tokens_per_s_median']:9.1f} tok/s median ({v['tokens_per_s_min']:.1f} min), "
              f"decode steps {v['decode_steps']}")
    print(f"refilled / chunked: {summary['ratio_median']:.2f}x median, {summary['ratio_min']:.2f}x min")
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
