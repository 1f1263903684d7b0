"""One SFT optimizer step of a Qwen2.5-VL-3B-shaped model: tokens/s and MFU.

The numbers a user compares with Megatron, torchtitan and verl: random weights (fp32 master,
bf16 compute through FSDP2's mixed precision on a one-rank mesh, as a training job runs), fused
AdamW, activation checkpointing of every decoder layer, one packed micro-batch of `--tokens`
tokens (`--samples` samples back to back, each with one 448 x 448 image = 256 merged vision tokens)
through `TokenLogprobModel` (the same loss path as the SFT loop), backward, clip, step.

MFU = model FLOPs / (step time x peak), the peak being a large bf16 matmul measured in the same run
(not the datasheet), model FLOPs = 6 x (non-embedding language-model parameters) x tokens +
3 x causal attention forward FLOPs (4 x heads x head_dim x sum of squared sample lengths / 2 per
layer) + 6 x vision parameters x patches. Activation recomputation is not counted (the usual MFU
convention; HFU would count it). Target: SFT MFU >= 40% on an H100 / H200.

    python benchmarks/e2e/bench_train_step.py                # GPU, 3B shape, 8k tokens
    python benchmarks/e2e/bench_train_step.py --quick        # CPU smoke test (tiny model)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import make_prompts, positive_int, qwen2_5_vl_3b_config, tiny_config  # noqa: E402

from megatron_vlm.data.batch import shifted_labels  # noqa: E402
from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import apply_ac, build_mesh, clip_grad_norm_, init_distributed  # noqa: E402
from megatron_vlm.parallel.master_weights import MasterWeights  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.optim import build_optimizer  # noqa: E402


def packed_batch(cfg: dict, n_samples: int, tokens: int, grid: tuple[int, int, int], seed: int = 1) -> dict:
    """`n_samples` image + text samples of tokens // n_samples tokens each, packed into one row."""
    per_sample = tokens // n_samples
    n_img = grid[0] * grid[1] * grid[2] // 4
    prompts = make_prompts(n_samples, grid, per_sample - n_img - 2, cfg, seed=seed)
    ids = torch.cat([p.input_ids for p in prompts])
    lengths = [len(p) for p in prompts]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    train = torch.zeros_like(ids, dtype=torch.bool)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        train[s + (e - s) // 2:e] = True  # the second half of every sample is the "answer"
    train &= ids != cfg["image_token_id"]
    return {"input_ids": ids[None], "labels": shifted_labels(ids, train, cu)[None], "cu_seqlens": cu,
            "pixel_values": torch.cat([p.pixel_values for p in prompts]),
            "image_grid_thw": torch.cat([p.image_grid_thw for p in prompts]), "lengths": lengths}


def model_flops(model, cfg: dict, lengths: list[int], patches: int) -> float:
    text = cfg["text_config"]
    lm = sum(p.numel() for n, p in model.named_parameters() if n.startswith("language_model.") and "embed" not in n)
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual."))
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    attn_fwd = text["num_hidden_layers"] * 4 * text["num_attention_heads"] * head_dim * sum(s * s for s in lengths) / 2
    return 6.0 * lm * sum(lengths) + 3.0 * attn_fwd + 6.0 * vision * patches


def matmul_peak_tflops(device: torch.device, quick: bool) -> float:
    n = 256 if quick else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(5 if quick else 20):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e12


def profile_step(step, device: torch.device, path: Path) -> None:
    """One step under torch.profiler: device time by kernel (top 40) and by category, and the step's wall time,
    so that `1 - kernel time / wall time` is the share of the step the GPU waited on the host."""
    from kernel_table import categories, kernel_rows
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    rows = kernel_rows(prof, device.type)
    kernel_ms = sum(r["ms"] for r in rows)
    cats = categories(rows)
    out = {"wall_ms": wall_ms, "kernel_ms": kernel_ms, "device_busy": kernel_ms / wall_ms,
           "categories": {c: {"ms": ms, "share_of_kernels": ms / kernel_ms} for c, ms in sorted(cats.items(), key=lambda x: -x[1])},
           "kernels": rows[:40]}
    path.write_text(json.dumps(out, indent=2))
    print(f"profile: wall {wall_ms:.1f} ms, kernels {kernel_ms:.1f} ms ({kernel_ms / wall_ms:.1%} busy)")
    for c, v in out["categories"].items():
        print(f"  {c:32s} {v['ms']:9.1f} ms {v['share_of_kernels']:6.1%}")
    for r in rows[:15]:
        print(f"  {r['ms']:9.2f} ms {r['calls']:6d}x {r['name'][:100]}")


def kernel_choice(kernels: str | None, attention: str | None) -> dict[str, str]:
    """{op: backend} from --kernels ("op=backend,...") and --attention; ValueError for a malformed entry."""
    choice: dict[str, str] = {}
    for part in filter(None, (kernels or "").split(",")):
        op, sep, backend = part.partition("=")
        if not sep or not op.strip() or not backend.strip():
            raise ValueError(f"--kernels takes op=backend pairs, comma-separated; got {part!r}")
        choice[op.strip()] = backend.strip()
    if attention:
        choice["attention"] = attention
    return choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--steps", type=positive_int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the packed micro-batch")
    ap.add_argument("--samples", type=int, default=4, help="samples in the pack")
    ap.add_argument("--no-ac", action="store_true", help="disable activation checkpointing (same as --ac off)")
    ap.add_argument("--ac", choices=("full", "selective", "off"), default="full",
                    help="activation checkpointing of every block: whole blocks, selective (matmul / attention outputs "
                         "kept, the rest recomputed) or none")
    ap.add_argument("--ac-full-blocks", type=int, default=0, metavar="N",
                    help="with --ac selective: checkpoint the first N transformer blocks whole instead (the model's "
                         "order: the vision blocks, then the decoder layers). Vision blocks first: per recomputed FLOP "
                         "they free about twice a decoder layer's memory at this shape (fewer patches than tokens "
                         "through a narrower block, same activation count per row)")
    ap.add_argument("--attention", default=None, metavar="BACKEND",
                    help="force the attention backend (kernels.attention: triton, sdpa, torch_varlen, flash_attn, ...)")
    ap.add_argument("--kernels", default=None, metavar="OP=BACKEND,...",
                    help="force backends of other ops, e.g. rms_norm=torch,swiglu=torch,apply_rotary=torch (under "
                         "--compile the pure-torch references are traced, so inductor can fuse them with their neighbours; "
                         "our Triton kernels are opaque custom ops to it)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every block (parallel.compile)")
    ap.add_argument("--reshard", choices=("on", "off"), default="on",
                    help="parallel.reshard_after_forward: 'off' keeps each block's gathered bf16 parameters from the "
                         "forward to its backward (no second cast / gather; more memory)")
    ap.add_argument("--profile", type=str, default=None, metavar="PATH",
                    help="torch.profiler over one step after the timed ones: kernel table + categories as JSON")
    ap.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                    help="cap this process's CUDA allocator at GIB (torch.cuda.set_per_process_memory_fraction): "
                         "whether a setting fits a smaller card, e.g. 79 for an 80 GB H100 on an H200; a step that "
                         "does not fit is reported (\"oom\" in the JSON, exit 3), not a traceback")
    ap.add_argument("--moments", choices=("fp32", "bf16"), default="fp32",
                    help="optimizer.moments_dtype: AdamW's moments in bf16 (our fused kernel; 4 instead of 8 bytes per "
                         "parameter) instead of torch's fused fp32 AdamW")
    ap.add_argument("--no-fsdp", action="store_true",
                    help="parallel.fsdp = false (one process): bf16 weights with fp32 masters in the optimizer instead of "
                         "FSDP2's per-block casts and copies (with --quick too, so the smoke test runs this path)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    env = init_distributed()
    device = env.device
    if args.memory_cap_gib is not None:
        if device.type != "cuda":
            ap.error("--memory-cap-gib caps the CUDA allocator; this run has no CUDA device")
        total = torch.cuda.get_device_properties(device).total_memory
        if not 0 < args.memory_cap_gib * 2**30 <= total:
            ap.error(f"--memory-cap-gib {args.memory_cap_gib}: must be > 0 and <= the card's {total / 2**30:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total, device)
    try:
        choice = kernel_choice(args.kernels, args.attention)
    except ValueError as e:
        ap.error(str(e))  # exit 2, before anything is built
    if choice:
        from megatron_vlm.kernels import registry

        registry.configure(choice)
    if args.quick:
        torch.set_num_threads(1)
        cfg, grid, tokens, param_dtype = tiny_config(), (1, 8, 8), min(args.tokens, 256), None
    else:
        cfg, grid, tokens, param_dtype = qwen2_5_vl_3b_config(), (1, 32, 32), args.tokens, torch.bfloat16
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    wrapper = TokenLogprobModel(model)
    ac = "off" if args.no_ac else args.ac
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=args.compile, reshard_after_forward=args.reshard == "on")
    dims, mesh = build_mesh(parallel, env.world_size, device.type)
    if args.no_fsdp:
        if env.world_size > 1:
            ap.error("--no-fsdp runs one process")
        mesh, param_dtype = None, torch.bfloat16
    if args.ac_full_blocks:
        blocks = model.transformer_blocks()
        if ac != "selective" or not 0 < args.ac_full_blocks <= len(blocks):
            ap.error(f"--ac-full-blocks {args.ac_full_blocks}: with --ac selective, 1..{len(blocks)} (blocks of this model)")
        apply_ac(blocks[:args.ac_full_blocks], policy="full")  # parallelize leaves checkpointed blocks as they are
    # train.activation_checkpointing's values: the order a family's parallelize applies (AC -> compile -> FSDP)
    get_family(model.hf_config.get("model_type")).parallelize(
        model, dims, parallel, mesh=mesh, param_dtype=param_dtype, root=wrapper,
        activation_checkpointing=False if ac == "off" else ac)
    masters = MasterWeights(wrapper, torch.bfloat16) if args.no_fsdp else None
    optimizer = build_optimizer(wrapper, SimpleNamespace(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                                         moments_dtype=args.moments), device.type)
    params = [p if masters is None else masters.params_or(p) for p in wrapper.parameters() if p.requires_grad]
    batch = packed_batch(cfg, args.samples, tokens, grid)
    lengths = batch.pop("lengths")
    batch = {k: v.to(device) for k, v in batch.items()}
    n_tokens = int(batch["input_ids"].numel())
    n_trained = int((batch["labels"] != -100).sum())

    def step() -> None:
        logp = wrapper(batch)
        (-logp.sum(dtype=torch.float32) / n_trained).backward()
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (1 thread)", "torch": torch.__version__,
            "quick": args.quick, "tokens": n_tokens, "samples": args.samples, "activation_checkpointing": ac,
            "ac_full_blocks": args.ac_full_blocks, "compile": args.compile,
            "reshard_after_forward": args.reshard == "on", "moments_dtype": args.moments, "fsdp": not args.no_fsdp,
            "attention": args.attention or "auto", "kernels": choice, "memory_cap_gib": args.memory_cap_gib,
            "date": time.strftime("%Y-%m-%d")}
    for i in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            step()
        except torch.OutOfMemoryError as e:  # the setting does not fit (the cap, or the card): a result, not a crash
            oom = {"oom": True, "at_step": i, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if
                   device.type == "cuda" else None, "error": str(e).splitlines()[0][:300]}
            print(json.dumps({"meta": meta, "summary": oom}))
            if args.json:
                Path(args.json).write_text(json.dumps({"meta": meta, "summary": oom}, indent=2))
            sys.exit(3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i > 0:  # the first step warms up (allocator, kernel selection, autotuning)
            times.append(time.perf_counter() - t0)
    if args.profile:
        profile_step(step, device, Path(args.profile))
    peak = matmul_peak_tflops(device, args.quick)
    flops = model_flops(model, cfg, lengths, int(batch["pixel_values"].shape[0]))
    step_s = statistics.median(times)
    summary = {
        "step_s_median": step_s, "step_s_min": min(times), "tokens_per_s": n_tokens / step_s,
        "model_tflops_per_step": flops / 1e12, "matmul_peak_tflops": peak,
        "mfu": flops / step_s / (peak * 1e12),
    }
    if device.type == "cuda":
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for k, v in summary.items():
        print(f"{k:24s} {v:12.4g}")
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
