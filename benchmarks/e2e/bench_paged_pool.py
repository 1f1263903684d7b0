"""Rollout throughput under a fixed KV-cache memory: the slot cache vs the paged pool allocated on demand.

What a user with a KV budget gets: the slot cache holds every sequence at full length (prompt + budget), so a
budget of K full-length sequences runs K at a time; the paged pool of the same memory hands blocks out as
completions grow (preempting the last admitted when it runs out), so it can run many more sequences while most
are still short. Completion lengths are made realistic on a random-weights model by an end-of-sequence set of
`--eos-frac` of the vocabulary (a geometric length distribution, mean ~1 / eos_frac tokens, cut at the budget).

Both engines decode the same prompts, sampling at temperature 1, interleaved rounds after one warm-up each;
reported: tokens/s (min / median of the rounds), the ratio, mean rows per decode step and preemptions.

    python benchmarks/e2e/bench_paged_pool.py --cpu         # CPU row (small Qwen2.5-VL layout)
    python benchmarks/e2e/bench_paged_pool.py --quick       # smoke test (tiny model)
    python benchmarks/e2e/bench_paged_pool.py               # GPU: Qwen2.5-VL-3B shape, CUDA graphs
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

from bench_rollout import NoDecode, interleaved, positive_int  # noqa: E402
from geometric_rollouts import add_common_args, build_setup, rates, ratio  # noqa: E402

from megatron_vlm.inference.decode_graphs import DecodeStepRunner  # noqa: E402
from megatron_vlm.inference.engine import SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models.common.slot_cache import SlotCache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, group=8, new_tokens=256, eos_frac=0.02)
    ap.add_argument("--full-seqs", type=positive_int, default=8,
                    help="the KV budget, in sequences of prompt + budget (the slot cache's slot count)")
    ap.add_argument("--paged-slots", type=positive_int, default=32, help="slots of the paged engine")
    ap.add_argument("--block", type=positive_int, default=16, help="positions per block")
    args = ap.parse_args()
    setup = build_setup(args)
    device, gpu, model, prompts, eos = setup.device, setup.gpu, setup.model, setup.prompts, setup.eos
    full_len = max(len(p) for p in prompts) + args.new_tokens
    blocks = 1 + args.full_seqs * -(-full_len // args.block)  # the same positions as full_seqs slots (+ scratch)
    graphs = "on" if gpu else "off"
    common = dict(eos_token_ids=eos, device=device, cuda_graphs=graphs)
    engines = {
        "slot_cache": PolicyRolloutEngine(model, NoDecode(), EngineOptions(max_num_seqs=args.full_seqs, **common)),
        "paged_on_demand": PolicyRolloutEngine(model, NoDecode(), EngineOptions(
            max_num_seqs=args.paged_slots, kv_block_size=args.block, kv_cache_blocks=blocks, **common)),
    }
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.group, temperature=1.0)
    rows: dict[str, list[int]] = {k: [] for k in engines}
    results: dict[str, list] = {k: [] for k in engines}
    current = {"name": ""}
    # rows per decode step: a static step counts its bucket, padding included, at the runner (a replayed CUDA graph
    # runs no Python, so no begin_step); an eager step at the cache (PagedSlotCache's begin_step calls this one)
    begin, step = SlotCache.begin_step, DecodeStepRunner.step

    def begin_spy(self, n_new, new_mask=None):
        if current["name"] and not self._static:
            rows[current["name"]].append(len(self._active_list))
        return begin(self, n_new, new_mask)

    def step_spy(self, slots, input_ids):
        if current["name"]:
            rows[current["name"]].append(self.bucket_for(len(slots)))
        return step(self, slots, input_ids)

    SlotCache.begin_step = begin_spy  # type: ignore[method-assign]
    DecodeStepRunner.step = step_spy  # type: ignore[method-assign]

    def runner(name):
        def run():
            current["name"] = name
            results[name].append(engines[name].generate(prompts, params, generator=torch.Generator(device).manual_seed(3)))
            current["name"] = ""
        return run

    times = interleaved({k: runner(k) for k in engines}, device, args.repeats)
    out = {}
    for name in engines:
        res = results[name][1:]  # the warm-up call is not timed
        out[name] = {**rates([r.num_generated_tokens for r in res], times[name]),
                     "preemptions": [r.stats["preemptions"] for r in res],
                     "mean_rows_per_step": statistics.mean(rows[name]) if rows[name] else 0.0}
    summary = {**ratio(out["paged_on_demand"], out["slot_cache"]), "engines": out}
    meta = {"device": setup.device_name, "torch": torch.__version__, "prompts": args.prompts,
            "group": args.group, "new_tokens": args.new_tokens, "full_seqs": args.full_seqs, "paged_slots": args.paged_slots,
            "block": args.block, "pool_blocks": blocks, "eos_frac": args.eos_frac, "cuda_graphs": graphs,
            "date": time.strftime("%Y-%m-%d")}
    for name, v in out.items():
        print(f"{name:16s} {v['tokens_per_s_median']:9.1f} tok/s median ({v['tokens_per_s_min']:.1f} min), "
              f"{v['mean_rows_per_step']:.1f} rows/step, preemptions {v['preemptions']}")
    print(f"paged / slot: {summary['ratio_median']:.2f}x median, {summary['ratio_min']:.2f}x min")
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
