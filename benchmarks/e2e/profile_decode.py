"""Decode step of the rollout engine: time per step, achieved HBM bandwidth and a kernel table (GPU).

Decoding is memory-bound: every step reads all language-model weights once plus the cached keys and
values of every running sequence. The honest distance to the hardware is therefore

    achieved bandwidth = (weight bytes + KV bytes read per step) / step time

as a fraction of the copy bandwidth measured in the same process (a large device-to-device copy,
bytes read + written). The step time is taken from two `generate` calls of the same shape that differ
only in their number of new tokens (`--short` and `--short + --steps`), so prefill, vision tower and
host set-up cancel: step = (t_long - t_short) / steps. Each variant (decode-attention backend x eager /
CUDA-graph steps, optionally x shared prompt reads: a group's prompt read through one copy, x fused: q / k / v
in one GEMM per attention layer and its keys / values written to the cache in one launch) is built once, warmed up (graph captures happen there), then the calls are
interleaved over `--rounds` rounds; min and median are reported.

`--profile` adds a `torch.profiler` kernel table of the first variant's long call minus nothing: the
table lists the kernels by total CUDA time, with calls and time per decode step (total / steps of the
call), so the share of attention, GEMMs, norms and sampling in a step is read off directly.

    python benchmarks/e2e/profile_decode.py --json out.json --profile         # 3B shape, GPU
    python benchmarks/e2e/profile_decode.py --quick                           # CPU smoke test
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

from bench_rollout import NoDecode, make_prompts, qwen2_5_vl_3b_config, tiny_config  # noqa: E402

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.kernels import registry  # noqa: E402
from megatron_vlm.models import build_model  # noqa: E402
from megatron_vlm.models.common.fused_projections import fuse_qkv  # noqa: E402


def copy_bandwidth_gbs(device: str, quick: bool) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), best of 10."""
    n = (1 << 20) if quick else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def decode_bytes(model, cfg: dict, n_seqs: int, cached_tokens_per_seq: float, dtype_bytes: int) -> dict:
    """Bytes one decode step must read: decoder weights (the embedding table is gathered, not read, unless
    tied to the output head, which reads it whole) and every running sequence's cached keys and values."""
    text = cfg["text_config"]
    params = dict(model.named_parameters())  # named_parameters lists a tied weight once
    experts = {n for n in params if ".experts." in n}
    weights = sum(p.numel() for n, p in params.items()
                  if n.startswith("language_model.") and "embed_tokens" not in n and n not in experts)
    head = params.get("lm_head.weight", params.get("language_model.embed_tokens.weight"))
    weights = (weights + head.numel()) * dtype_bytes
    hit = 1.0
    if experts:  # a step reads only the experts some token chose: expected share for uniform routing
        from megatron_vlm.models.common.moe import moe_layers

        block = moe_layers(model)[0]
        e, k = block.num_experts, block.top_k
        hit = 1.0 - (1.0 - k / e) ** n_seqs
        weights += hit * sum(params[n].numel() for n in experts) * dtype_bytes
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * dtype_bytes * n_seqs * cached_tokens_per_seq
    return {"weight_bytes": weights, "kv_bytes": kv, "total": weights + kv, "expert_hit_fraction": hit}


def kernel_table(prof, steps: int, device: str, top: int = 25) -> list[dict]:
    """The call's kernels (kernel_table.kernel_rows), with time per decode step and share of the call."""
    from kernel_table import kernel_rows

    rows = kernel_rows(prof, device)
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["ms_per_step"] = r["ms"] / steps
        r["share"] = r["ms"] / total if total else 0.0
    return rows[:top]


def ep_copy(model, device: str):
    """A copy of `model` whose MoE blocks hold their experts over a one-rank expert-parallel group (NCCL on a GPU,
    gloo elsewhere; the process group is made here): the lock-step rollout form of `rl.rollout.weights =
    "expert_parallel"`, whose static decode steps run the all-gather / reduce-scatter exchange."""
    import copy
    import os

    import torch.distributed as dist

    from megatron_vlm.models.common.moe import moe_layers
    from megatron_vlm.parallel.expert_parallel import apply_ep

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                **({"device_id": torch.device("cuda", 0)} if device == "cuda" else {}))
    out = copy.deepcopy(model)
    if not moe_layers(out):
        raise ValueError("the 'ep' variant needs a MoE model (--moe-slice)")
    apply_ep(moe_layers(out), dist.group.WORLD)
    return out


def variant_list(text: str) -> list[tuple[str, str, frozenset]]:
    """argparse type of --variants: (backend, cuda_graphs, flags) per comma-separated entry. Checked while parsing,
    so that a lease command with a misspelt variant fails before anything is built (and the lease script's parse
    test sees it)."""
    parts = [v.split(":") for v in text.split(",") if v]
    bad = [":".join(p) for p in parts if len(p) < 2 or p[1] not in ("on", "off", "auto")
           or not set(p[2:]) <= {"shared", "fused", "ep"} or len(set(p[2:])) != len(p[2:])]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"backend:on|off|auto[:shared][:fused][:ep], comma-separated; got {bad or text!r}")
    return [(p[0], p[1], frozenset(p[2:])) for p in parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--short", type=int, default=8, help="new tokens of the short call")
    ap.add_argument("--steps", type=int, default=48, help="extra decode steps of the long call")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", type=variant_list, default=variant_list("triton:on,torch:on,triton:off,torch:off"),
                    help="decode_attention backend:cuda_graphs pairs, comma-separated; further parts: 'shared' reads a "
                         "group's shared prompt through one copy (EngineOptions.share_prefix_reads), 'fused' runs q / k / v "
                         "as one GEMM (EngineOptions.fuse_projections) and writes keys / values in one launch "
                         "(kernels.kv_cache_write = triton), 'ep' (with --moe-slice) decodes on an expert-parallel copy "
                         "of one rank in lock-step (the 30B recipes' rollout form: its static steps exchange rows with "
                         "an NCCL all-gather / reduce-scatter, captured in the graph), e.g. triton:on:shared:fused")
    ap.add_argument("--moe-slice", type=int, default=0, metavar="LAYERS",
                    help="Qwen3-VL-30B-A3B at full width with only LAYERS decoder layers (MoE, 128 experts, top 8; "
                         "text prompts), instead of the dense 3B shape: the MoE decode step, to extrapolate to 48 layers")
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length of --moe-slice's text prompts")
    ap.add_argument("--profile", action="store_true", help="kernel table of the first variant's long call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.quick:
        torch.set_num_threads(1)
        cfg, dtype, grid, text_tokens = tiny_config(), torch.float32, (1, 8, 8), 24
        variants = [("torch", "off", frozenset())]
        args.short, args.steps, args.rounds = 2, 4, 1
    else:
        cfg, dtype, grid, text_tokens = qwen2_5_vl_3b_config(), torch.bfloat16, (1, 56, 64), 104
        variants = args.variants
    if args.moe_slice:
        from tests.fixtures.real_configs import real_config

        cfg = real_config("qwen3_vl_30b_a3b")
        cfg["text_config"]["num_hidden_layers"] = args.moe_slice
        cfg["vision_config"]["depth"] = 1
        cfg["vision_config"]["deepstack_visual_indexes"] = []
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype, device=device)
    model.init_weights()
    model.eval()
    if any("fused" in flags for _, _, flags in variants):
        # before any engine: fusing re-makes the q / k / v Parameters, which graphs captured earlier would still read
        # (the unfused variants run the same values through the views)
        fuse_qkv(model)
    if args.moe_slice:
        g = torch.Generator().manual_seed(1)
        prompts = [RolloutPrompt(torch.randint(10, 150000, (args.prompt_tokens,), generator=g)) for _ in range(args.prompts)]
    else:
        prompts = make_prompts(args.prompts, grid, text_tokens, cfg, seed=1)
    n_seqs = args.prompts * args.group
    out = {"meta": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "prompts": args.prompts, "group": args.group, "prompt_tokens": len(prompts[0]),
                    "short": args.short, "steps": args.steps, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d"),
                    "model": f"qwen3_vl_30b_a3b, {args.moe_slice} of 48 layers" if args.moe_slice else "qwen2_5_vl_3b"},
           "variants": {}}
    peak = copy_bandwidth_gbs(device, args.quick)
    out["meta"]["copy_peak_gbs"] = peak
    print(f"copy peak {peak:.0f} GB/s; {n_seqs} sequences, {len(prompts[0])}-token prompts", flush=True)

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))

    calls = {}
    for backend, graphs, flags in variants:
        name = (f"decode_attention={backend}, cuda_graphs={graphs}" + (", shared prompt reads" if "shared" in flags else "")
                + (", fused qkv" if "fused" in flags else ""))
        # fused: q / k / v in one GEMM and each layer's keys / values written in one launch (kernels.kv_cache_write)
        # (both the default on CUDA since the 2026-11-28 H200 run: the other variants pin the unfused forms)
        choice = {"decode_attention": backend, "kv_cache_write": "triton" if "fused" in flags else "torch"}
        if "ep" in flags:
            name += ", expert-parallel copy (1 rank, lock-step)"
        with registry.use_backends(choice):
            eng = PolicyRolloutEngine(ep_copy(model, device) if "ep" in flags else model, NoDecode(), EngineOptions(
                eos_token_ids=[-1], share_prefix=True, device=device, cuda_graphs=graphs,
                share_prefix_reads="shared" in flags, fuse_projections="fused" in flags),
                **({"all_ranks_active": lambda active: active} if "ep" in flags else {}))
        for n_new in (args.short, args.short + args.steps):
            params = SamplingParams(max_new_tokens=n_new, n=args.group, temperature=1.0)

            def call(eng=eng, params=params, choice=choice):
                gen = torch.Generator(device=device).manual_seed(0)
                with registry.use_backends(choice):
                    return eng.generate(prompts, params, generator=gen)
            calls[(name, n_new)] = call
        t0 = time.perf_counter()
        try:
            calls[(name, args.short)]()
            calls[(name, args.short + args.steps)]()  # warm-up: captures, autotuning, allocator
        except Exception as exc:  # a variant that cannot run here is reported, not fatal
            out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{name}: {out['variants'][name]['error']}", flush=True)
            calls.pop((name, args.short)), calls.pop((name, args.short + args.steps))
            continue
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        out["variants"][name] = {"short_s": [], "long_s": []}
    for _ in range(args.rounds):
        for name in [n for n in out["variants"] if "error" not in out["variants"][n]]:
            for key, n_new in (("short_s", args.short), ("long_s", args.short + args.steps)):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                calls[(name, n_new)]()
                if device == "cuda":
                    torch.cuda.synchronize()
                out["variants"][name][key].append(time.perf_counter() - t0)
    cached = len(prompts[0]) + args.short + args.steps / 2  # average keys per sequence over the timed steps
    need = decode_bytes(model, cfg, n_seqs, cached, torch.finfo(dtype).bits // 8)
    out["meta"]["bytes_per_step"] = need
    for name, v in out["variants"].items():
        if "error" in v:
            continue
        steps = [(lo - sh) / args.steps for sh, lo in zip(v["short_s"], v["long_s"])]
        v["step_ms_median"] = statistics.median(steps) * 1e3
        v["step_ms_min"] = min(steps) * 1e3
        v["hbm_fraction_best"] = need["total"] / min(steps) / 1e9 / peak
        v["hbm_fraction_median"] = need["total"] / statistics.median(steps) / 1e9 / peak
        v["tokens_per_s_decode"] = n_seqs / statistics.median(steps)
        print(f"{name}: step {v['step_ms_median']:.2f} ms median ({v['step_ms_min']:.2f} min), "
              f"{v['hbm_fraction_best']:.1%} of copy bandwidth at best ({need['total'] / 1e9:.2f} GB per step)", flush=True)
    save()
    if args.profile and calls:
        name = next(n for n in out["variants"] if "error" not in out["variants"][n])
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            calls[(name, args.short + args.steps)]()
            if device == "cuda":
                torch.cuda.synchronize()
        table = kernel_table(prof, args.short + args.steps, device)
        out["profile"] = {"variant": name, "steps_in_call": args.short + args.steps, "kernels": table}
        print(f"kernel table ({name}, per decode step of a {args.short + args.steps}-token call, prefill included):")
        for r in table:
            print(f"  {r['share']:6.1%} {r['ms_per_step']:8.3f} ms/step {r['calls']:7d} calls  {r['name']}")
        save()


if __name__ == "__main__":
    main()
