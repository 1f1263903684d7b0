"""Where a row's time goes, ours and vLLM side by side: torch.profiler over one call of each engine.

Why one profiler for both: vLLM's CPU build runs its model in this process (in-process engine core,
"uni" executor), so the same `torch.profiler` sees its ops (the compiled graph's kernels, its CPU attention
custom op, its sampler) as it sees ours; the two tables are comparable op for op. The row, prompts and
engines are those of `bench_rollout.py --engines ours,vllm --row X` (rollout_engines_row.prepare_row); each
engine gets one warm-up call (vLLM compiles there), then one profiled call.

    python benchmarks/e2e/profile_rollout_row.py --row b --threads 1 [--top 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_engines_row import parse_engines, prepare_row  # noqa: E402
from rollout_rows import resolve_rows  # noqa: E402

GROUPS = (  # op-name fragments -> the share of a call they are counted in (first match wins)
    ("gemm", ("addmm", "aten::mm", "aten::bmm", "linear", "matmul", "mkl", "onednn", "gemm", "cpp_fused_mm")),
    ("attention", ("attention", "attn", "sdpa", "flash", "paged", "decode_attention")),
    ("sampling", ("softmax", "exp", "cumsum", "multinomial", "argmax", "topk", "sort", "sample", "logprob", "exponential")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def profile_call(fn, top: int, shapes: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        n, seconds, stats = fn()
    events = [e for e in prof.key_averages(group_by_input_shape=shapes) if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    total_us = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = {}
    for e in events:
        shares[group_of(e.key)] = shares.get(group_of(e.key), 0.0) + e.self_cpu_time_total / total_us
    table = [{"op": e.key + (f" {e.input_shapes}" if shapes else ""), "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total_us}
             for e in events[:top]]
    return {"tokens": n, "seconds": seconds, "profiled_self_ms": total_us / 1e3, "groups": shares, "top": table,
            "decode_steps": stats.get("decode_steps"), "decode_s": stats.get("decode_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", required=True, help="one row: a..e or its name (rollout_rows.py)")
    ap.add_argument("--engines", default="ours,vllm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--vllm-eager", action="store_true")
    ap.add_argument("--shapes", action="store_true", help="one table line per op and input shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        rows, engines = resolve_rows(args.row), parse_engines(args.engines)
    except ValueError as e:
        ap.error(str(e))
    if len(rows) != 1:
        ap.error("--row: one row at a time")
    import importlib.util

    if "vllm" in engines and importlib.util.find_spec("vllm") is None:  # before the row's model folder is built
        print("skipped: vLLM is not installed here; run it in the vLLM environment (docs/vllm.md: PYTHONPATH=$PWD "
              "$(bash .ci/vllm_env.sh | tail -1) benchmarks/e2e/profile_rollout_row.py ...), or pass --engines ours")
        return
    torch.set_num_threads(args.threads)
    spec, out = rows[0], {}
    with tempfile.TemporaryDirectory() as tmp:
        calls, info = prepare_row(spec, engines, args, Path(tmp), out)
        for name, fn in calls.items():
            n, s, _ = fn()
            print(f"warm-up {name}: {s:.2f} s, {n} tokens", flush=True)
        for name, fn in calls.items():
            out[name] = p = profile_call(fn, args.top, args.shapes)
            print(f"\n== row {spec.letter} {name}: {p['tokens']} tokens in {p['seconds']:.2f} s "
                  f"({p['tokens'] / p['seconds']:.1f} tok/s under the profiler; load {os.getloadavg()[0]:.1f}); "
                  + ", ".join(f"{g} {v:.0%}" for g, v in sorted(p["groups"].items(), key=lambda kv: -kv[1])), flush=True)
            for r in p["top"]:
                print(f"  {r['self_ms']:10.1f} ms {r['share']:6.1%} {r['calls']:8d}  {r['op'][:160]}")
        info["close"]()
    if args.json:
        Path(args.json).write_text(json.dumps({"row": spec.letter, "threads": args.threads, **out}, indent=2))


if __name__ == "__main__":
    main()
