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
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import NoDecode, interleaved, positive_int  # noqa: E402
from geometric_rollouts import add_common_args, build_setup, rates, ratio  # noqa: E402

from megatron_vlm.inference.engine import SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, group=4, new_tokens=128, eos_frac=0.02)
    ap.add_argument("--batch-prompts", type=positive_int, default=2, help="prompts whose samples decode at once")
    args = ap.parse_args()
    setup = build_setup(args)
    device, model, prompts, eos = setup.device, setup.model, setup.prompts, setup.eos
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
    out = {name: {**rates(tokens[name][1:], times[name]), "decode_steps": steps[name][1:]}  # warm-up call not timed
           for name in ("chunked", "refilled")}
    summary = {**ratio(out["refilled"], out["chunked"]), "runs": out}
    meta = {"device": setup.device_name, "torch": torch.__version__, "prompts": args.prompts,
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
