"""Loss curves of one small model trained with AdamW's moments in fp32 and in bf16 (`optimizer.moments_dtype`).

Each variant trains the same model from the same initial weights on the same packed batches of a fixed random
bigram language (`fp8_loss_curve.py`'s: the loss falls from ln(vocab) towards ln(branching)), through the SFT
job's path (FSDP2 units, `TokenLogprobModel`, `build_optimizer`, gradient clipping at 1, linear warmup), with the
default betas (0.9, 0.999), where bf16's rounding matters most. Variants:

- `fp32`: torch's fused AdamW (the default);
- `bf16`: our AdamW with bf16 moments, rounded stochastically (`training/adamw_bf16.py`);
- `bf16_nearest` (ablation, this script only): the same with the moments rounded to nearest, which is what a plain
  `.to(torch.bfloat16)` store does: with beta2 = 0.999 the second moment then stops decaying.

Reported against fp32: the largest per-step |loss difference| and the difference of the last-10-step mean losses
(`final_abs_diff`, within `--tolerance`, default 0.05 nats, as fp8_loss_curve.py).

    python benchmarks/e2e/moments_loss_curve.py --json moments.json     # CPU, ~10 min; GPU: seconds
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_loss_curve import BigramLanguage, compare_curves, run_steps, small_config  # noqa: E402

from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import build_mesh, init_distributed  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.optim import build_optimizer  # noqa: E402

VARIANTS = ("fp32", "bf16", "bf16_nearest")


def _nearest(x: torch.Tensor, rand16: torch.Tensor) -> torch.Tensor:  # noqa: ARG001 -- the ablation ignores the bits
    return x.to(torch.bfloat16)


def train_curve(variant: str, cfg: dict, data: BigramLanguage, args, env) -> list[float]:
    import megatron_vlm.kernels.reference.adamw as ref

    device = env.device
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    wrapper = TokenLogprobModel(model)
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=False, reshard_after_forward=True)
    dims, mesh = build_mesh(parallel, env.world_size, device.type)
    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    get_family(model.hf_config.get("model_type")).parallelize(model, dims, parallel, mesh=mesh, param_dtype=param_dtype,
                                                              root=wrapper, activation_checkpointing=False)
    moments = "fp32" if variant == "fp32" else "bf16"
    optimizer = build_optimizer(wrapper, SimpleNamespace(lr=args.lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                                                         moments_dtype=moments), device.type, seed=0)
    saved = ref.round_bf16_stochastic
    if variant == "bf16_nearest":
        if device.type == "cuda":
            sys.exit("bf16_nearest: the ablation patches the torch reference (CPU); run it without CUDA")
        ref.round_bf16_stochastic = _nearest
    try:
        return run_steps(wrapper, optimizer, data, args, device)
    finally:
        ref.round_bf16_stochastic = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per packed batch")
    ap.add_argument("--samples", type=int, default=4, help="sequences per pack")
    ap.add_argument("--hidden", type=int, default=256, help="text hidden size (the layout of fp8_loss_curve's model)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--branching", type=int, default=4, help="successors per token of the bigram language")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"fp32 plus any of {','.join(VARIANTS[1:])}")
    ap.add_argument("--tolerance", type=float, default=0.05, help="bound on final_abs_diff (nats)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if "fp32" not in variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: fp32 plus a subset of {','.join(VARIANTS[1:])}")
    env = init_distributed()
    if env.device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = small_config(args.vocab)
    text = cfg["text_config"]
    heads = max(2, args.hidden // 64)
    text.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4))
    half = args.hidden // heads // 2
    text["rope_parameters"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    cfg["vision_config"]["out_hidden_size"] = args.hidden
    special = min(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))
    data = BigramLanguage(min(args.vocab, special), args.branching)
    t0 = time.perf_counter()
    curves = {v: train_curve(v, cfg, data, args, env) for v in variants}
    wall = time.perf_counter() - t0
    results = compare_curves(curves, "fp32", args.tolerance)
    meta = {"device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu", "torch": torch.__version__,
            "steps": args.steps, "tokens": args.tokens, "samples": args.samples, "lr": args.lr, "hidden": args.hidden,
            "layers": args.layers, "vocab": args.vocab, "branching": args.branching, "betas": [0.9, 0.999],
            "loss_floor": math.log(args.branching), "tolerance": args.tolerance, "wall_s": wall,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "curves": curves}, indent=2))


if __name__ == "__main__":
    main()
