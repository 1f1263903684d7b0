"""The SFT step in bf16 vs fp8 (torchao float8, tensorwise and rowwise scaling) at a Qwen2.5-VL-7B-width slice.

Shape: the 7B language model's widths (hidden 3584, intermediate 18944, 28 heads / 4 KV heads, vocabulary
152064, untied lm_head) with `--layers` decoder layers (default 4) and a `--vision-depth`-block slice of its
vision tower (default 2), one packed micro-batch of `--tokens` tokens (`--samples` samples, one 448 x 448
image each), fp32 master weights, bf16 compute through FSDP2's mixed precision on a one-rank mesh,
activation checkpointing and `torch.compile` of every block (torchao's float8 casts are fast only when
compiled), fused AdamW at learning rate 0 (the update runs at full cost and leaves the weights, so every
variant's loss is taken at the same weights: a variant whose loss equals bf16's bit for bit did not take
effect, and the run stops): the step `bench_train_step.py` times, through `TokenLogprobModel`.

The variants share one model and one optimizer, so that the three fit one H100 and run interleaved: the
model is converted once by `megatron_vlm.training.fp8.convert_to_fp8` (the training code path), then each
converted layer is switched between `nn.Linear` (bf16) and torchao's `Float8Linear` with the tensorwise
or rowwise configuration (`fp8_linear_config`, as training builds it) before that variant's steps.
Every round runs `--steps` timed steps of each variant in turn (after warm-up steps that compile each
variant); min and median step times per variant, tokens/s, the fp8/bf16 time ratio (< 1: fp8 faster; the
issue's target is bf16/fp8 >= 1.3) and the peak memory of each variant's steps are reported. The vision
tower and the lm_head stay bf16 in every variant, as in training.

    python benchmarks/e2e/bench_fp8.py --json fp8.json           # GPU (sm89+), the 7B-width slice
    python benchmarks/e2e/bench_fp8.py --quick                   # CPU smoke test (tiny model, emulated fp8)
Args: --layers N --vision-depth N --tokens N --samples N --rounds N --steps N --warmup N
      --variants bf16,tensorwise,rowwise --no-compile --ac full|selective|off --kernels OP=BACKEND,... --profile PREFIX
      --json PATH (--quick --compile: compiled blocks on the CPU)
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, tiny_config  # noqa: E402
from bench_train_step import kernel_choice, packed_batch, profile_step  # noqa: E402

from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import build_mesh, clip_grad_norm_, init_distributed  # noqa: E402
from megatron_vlm.training.fp8 import convert_to_fp8, fp8_linear_config  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.optim import build_optimizer  # noqa: E402

VARIANTS = ("bf16", "tensorwise", "rowwise")


def qwen2_5_vl_7b_slice_config(layers: int, vision_depth: int, vocab: int = 152064) -> dict:
    """Qwen2.5-VL-7B-Instruct's published widths with `layers` decoder layers and `vision_depth` vision blocks."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                         num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                         bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, tie_word_embeddings=False),
        vision_config=dict(depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[vision_depth - 1], tokens_per_second=2),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


def variant_switch(model: nn.Module, device: torch.device):
    """Convert `model` as training does, and return `use(variant)`, which switches every converted layer to
    plain `nn.Linear` (bf16) or to `Float8Linear` with that recipe's configuration. The layers keep their
    identity (and so their FSDP2 parameters); only their class and float8 configuration change."""
    n = convert_to_fp8(model, "tensorwise", device)  # first: it imports torchao with its load-time noise silenced
    from torchao.float8.float8_linear import Float8Linear

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == n
    emulate = device.type == "cpu"
    protos = {}
    for recipe in VARIANTS[1:]:
        with torch.device("meta"):
            protos[recipe] = Float8Linear(16, 16, bias=False, config=fp8_linear_config(recipe, emulate))
    state_keys = ("config", "linear_mm_config", "scaling_type_input", "scaling_type_weight", "scaling_type_grad_output")

    def use(variant: str) -> None:
        for layer in layers:
            if variant == "bf16":
                layer.__class__ = nn.Linear
            else:
                layer.__class__ = Float8Linear
                for k in state_keys:
                    setattr(layer, k, getattr(protos[variant], k))
    return use, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, fp8 emulated (smoke test)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 7B-width slice")
    ap.add_argument("--vision-depth", type=int, default=2, help="vision-tower blocks of the slice")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the packed micro-batch")
    ap.add_argument("--samples", type=int, default=4, help="samples in the pack (one 448 x 448 image each)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each runs every variant)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the rounds (compiles)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of bf16,tensorwise,rowwise")
    ap.add_argument("--no-compile", action="store_true", help="eager blocks (fp8 casts then run unfused)")
    ap.add_argument("--compile", action="store_true", help="with --quick: compile the blocks anyway (checks the switch)")
    ap.add_argument("--no-ac", action="store_true", help="disable activation checkpointing (same as --ac off)")
    ap.add_argument("--ac", choices=("full", "selective", "off"), default="full",
                    help="train.activation_checkpointing of every block: whole blocks (the float8 casts and GEMMs of the "
                         "forward run again in backward), selective (matmul outputs kept) or none")
    ap.add_argument("--kernels", default=None, metavar="OP=BACKEND,...",
                    help="force op backends, e.g. rms_norm=torch,swiglu=torch,apply_rotary=torch: compiled, inductor can "
                         "then fuse the float8 amax / cast into the norm and activation that produce the GEMM inputs "
                         "(our Triton kernels are opaque to it)")
    ap.add_argument("--profile", type=str, default=None, metavar="PREFIX",
                    help="after the rounds, torch.profiler over one step of each variant: PREFIX_<variant>.json "
                         "(kernel table and categories: where fp8 saves time and where it cannot)")
    ap.add_argument("--moments", choices=("fp32", "bf16"), default="fp32",
                    help="optimizer.moments_dtype of every variant: bf16 moments shrink the optimizer's fixed share of "
                         "the step, which fp8 does not speed up")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    try:
        choice = kernel_choice(args.kernels, None)
    except ValueError as e:
        ap.error(str(e))
    ac = "off" if args.no_ac else args.ac
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: a comma-separated subset of {','.join(VARIANTS)}")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:  # before any model is built: one line, no traceback
        print("skipped: torchao is not installed (pip install 'megatron-vlm[fp8]'): the fp8 variants need it")
        return
    if choice:
        from megatron_vlm.kernels import registry

        registry.configure(choice)
    env = init_distributed()
    device = env.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        sys.exit(f"bench_fp8: {torch.cuda.get_device_name(device)} has no float8 matmuls (compute capability < 8.9)")
    compile_blocks = not args.no_compile and (not args.quick or args.compile)
    if args.quick:
        torch.set_num_threads(1)
        cfg, grid, tokens = tiny_config(), (1, 8, 8), min(args.tokens, 256)
    else:
        cfg, grid, tokens = qwen2_5_vl_7b_slice_config(args.layers, args.vision_depth), (1, 32, 32), args.tokens
    if compile_blocks:  # one compiled graph per variant and block kind: room for all of them
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    use, n_fp8 = variant_switch(model, device)
    wrapper = TokenLogprobModel(model)
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=compile_blocks, reshard_after_forward=True)
    dims, mesh = build_mesh(parallel, env.world_size, device.type)
    get_family(model.hf_config.get("model_type")).parallelize(
        model, dims, parallel, mesh=mesh, param_dtype=torch.bfloat16, root=wrapper,
        activation_checkpointing=False if ac == "off" else ac)
    optimizer = build_optimizer(wrapper, SimpleNamespace(lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                                         moments_dtype=args.moments), device.type)
    params = [p for p in wrapper.parameters() if p.requires_grad]
    batch = packed_batch(cfg, args.samples, tokens, grid)
    batch.pop("lengths")
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    batch = {k: v.to(device) for k, v in batch.items()}
    n_tokens = int(batch["input_ids"].numel())
    n_trained = int((batch["labels"] != -100).sum())
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> float:
        logp = wrapper(batch)
        loss = -logp.sum(dtype=torch.float32) / n_trained
        loss.backward()
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times = {v: [] for v in variants}
    last_loss = {}
    peak = {v: 0.0 for v in variants}
    losses = {}
    t_warm = time.perf_counter()
    for v in variants:
        use(v)
        for _ in range(args.warmup):
            losses[v] = float(step())
    sync()
    warmup_s = time.perf_counter() - t_warm
    # lr 0 keeps the weights: equal losses would mean a variant did not take effect (e.g. a compiled block
    # that kept another variant's graph)
    for v in variants:
        if v != "bf16" and "bf16" in losses and losses[v] == losses["bf16"]:
            sys.exit(f"bench_fp8: variant {v} gave bf16's loss bit for bit ({losses[v]}): the switch did not take effect")
    for _ in range(args.rounds):
        for v in variants:
            use(v)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                loss = step()
                sync()
                times[v].append(time.perf_counter() - t0)
            last_loss[v] = float(loss)
            if cuda:
                peak[v] = max(peak[v], torch.cuda.max_memory_allocated() / 2**30)
    # and each variant, switched back to in the last round, still computes its own loss (nearest its warm-up one)
    for v in variants:
        nearest = min(variants, key=lambda u: abs(last_loss[v] - losses[u]))
        if abs(last_loss[v] - losses[nearest]) < abs(last_loss[v] - losses[v]):
            sys.exit(f"bench_fp8: variant {v} computed {nearest}'s loss in the last round: the switch did not take effect")
    if args.profile:  # after the timed rounds: profiling does not disturb them
        for v in variants:
            use(v)
            print(f"profile of {v}:")
            profile_step(step, device, Path(f"{args.profile}_{v}.json"))
    results = {}
    for v in variants:
        med = statistics.median(times[v])
        results[v] = {"step_s_min": min(times[v]), "step_s_median": med, "tokens_per_s": n_tokens / med,
                      "warmup_loss": losses[v]}
        if cuda:
            results[v]["peak_memory_gib"] = peak[v]
    if "bf16" in results:
        base = results["bf16"]
        for v in variants:
            if v != "bf16":
                results[v]["time_ratio_vs_bf16_median"] = results[v]["step_s_median"] / base["step_s_median"]
                results[v]["time_ratio_vs_bf16_min"] = results[v]["step_s_min"] / base["step_s_min"]
                results[v]["speedup_vs_bf16_median"] = base["step_s_median"] / results[v]["step_s_median"]
    print(f"{'variant':12s} {'min s':>9s} {'median s':>9s} {'tokens/s':>10s} {'fp8/bf16':>9s} {'peak GiB':>9s}")
    for v, r in results.items():
        ratio = r.get("time_ratio_vs_bf16_median")
        print(f"{v:12s} {r['step_s_min']:9.4f} {r['step_s_median']:9.4f} {r['tokens_per_s']:10.0f} "
              f"{'' if ratio is None else f'{ratio:.3f}':>9s} {r.get('peak_memory_gib', float('nan')):9.2f}")
    text = cfg["text_config"]
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (1 thread)", "torch": torch.__version__,
            "torchao": _version("torchao"), "quick": args.quick, "tokens": n_tokens, "trained_tokens": n_trained,
            "samples": args.samples, "layers": text["num_hidden_layers"], "hidden": text["hidden_size"],
            "intermediate": text["intermediate_size"], "heads": text["num_attention_heads"],
            "kv_heads": text["num_key_value_heads"], "vision_depth": cfg["vision_config"]["depth"],
            "fp8_linear_layers": n_fp8, "compile": compile_blocks, "activation_checkpointing": ac, "kernels": choice, "moments_dtype": args.moments,
            "rounds": args.rounds, "steps_per_round": args.steps, "warmup_s": warmup_s, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
