"""The fused CPU experts (`EngineOptions.cpu_fused_experts`) against the module path, in one process, interleaved.

Two measurements, both on the process CPU clock (time other jobs take from this core is not counted), min and
median over rounds:

* layer: one MoE layer's routed experts at a decode shape (default the tiny Qwen3-MoE row d's: 64 tokens,
  8 experts top 2, hidden 256, expert MLP 256, fp32): `GroupedExperts.forward` (permute, two grouped GEMMs,
  SwiGLU, unpermute) vs the fused op on packed weights (kernels/csrc/moe_experts.py);
* engine: row d of `bench_rollout.py --engines ours,vllm` (rollout_rows.py: the same folder and prompts), our
  engine with the fused experts vs the same engine with `cpu_fused_experts=False`, a call each per round.

    python benchmarks/e2e/bench_cpu_fused_experts.py [--row d] [--rounds 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_engines_row import _text_row  # noqa: E402
from rollout_rows import resolve_rows  # noqa: E402


def cpu_time(fn, reps: int = 1) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def summary(name: str, base: list[float], new: list[float]) -> str:
    ratios = [b / n for b, n in zip(base, new)]
    return (f"{name}: module path {statistics.median(base) * 1e3:.2f} ms, fused {statistics.median(new) * 1e3:.2f} ms "
            f"(medians); speed-up median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x over {len(ratios)} rounds")


def bench_layer(spec, rounds: int) -> None:
    from megatron_vlm.kernels.csrc import moe_experts as fused
    from megatron_vlm.models.common.moe import GroupedExperts

    g = torch.Generator().manual_seed(0)
    n, e, k, h, inter = spec.prompts * spec.group, spec.experts, spec.top_k, spec.hidden, spec.moe_intermediate
    mod = GroupedExperts(e, h, inter, activation="silu", gated=True)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    x = torch.randn(n, h, generator=g)
    w, ids = torch.softmax(torch.randn(n, e, generator=g), -1).topk(k, -1)
    p1, p2 = fused.pack_expert_weights(mod.gate_up_proj), fused.pack_expert_weights(mod.down_proj)
    p1, p2 = (p1, p2) if p1.numel() else (None, None)
    base, new = [], []
    with torch.inference_mode():
        ref = mod(x, ids, w)[0]
        got = fused.moe_experts(x, ids, w, mod.gate_up_proj, mod.down_proj, gated=True, activation="silu",
                                w1_packed=p1, w2_packed=p2)[0]
        print(f"layer {n} tokens x top {k} of {e} experts, hidden {h}, inter {inter}: max |fused - module| "
              f"{float((got - ref).abs().max()):.2e}; packed: {p1 is not None}")
        for _ in range(rounds):
            base.append(cpu_time(lambda: mod(x, ids, w), 50))
            new.append(cpu_time(lambda: fused.moe_experts(x, ids, w, mod.gate_up_proj, mod.down_proj, gated=True,
                                                          activation="silu", w1_packed=p1, w2_packed=p2), 50))
    print(summary("layer", base, new), flush=True)


def bench_engine(spec, rounds: int) -> None:
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine

    params = SamplingParams(max_new_tokens=spec.new_tokens, n=spec.group, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        _, prompts, _, tokenizer, _ = _text_row(spec, folder)
        engines = {}
        for name, on in (("module", False), ("fused", True)):
            model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
            engines[name] = PolicyRolloutEngine(model, tokenizer, EngineOptions(eos_token_ids=[-1], cpu_fused_experts=on))
        gen = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {"module": [], "fused": []}
        for eng in engines.values():
            eng.generate(prompts, params, generator=gen)  # warm-up
        for r in range(rounds):
            for name, eng in engines.items():
                times[name].append(cpu_time(lambda: eng.generate(prompts, params, generator=gen)))
            print(f"round {r + 1}: module path {times['module'][-1]:.2f} s, fused {times['fused'][-1]:.2f} s (CPU) "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    print(summary(f"engine row {spec.letter} call", times["module"], times["fused"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", default="d", help="a MoE row of rollout_rows.py")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true", help="the layer measurement only")
    args = ap.parse_args()
    spec = resolve_rows(args.row)[0]
    if not spec.experts:
        ap.error(f"--row {args.row}: not a MoE row")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()[0]:.2f}", flush=True)
    bench_layer(spec, args.rounds)
    if not args.skip_engine:
        bench_engine(spec, args.rounds)


if __name__ == "__main__":
    main()
