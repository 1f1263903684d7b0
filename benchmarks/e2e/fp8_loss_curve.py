"""Loss curves of a small model trained in bf16 and in fp8 (torchao float8, tensorwise / rowwise): how far apart.

Each variant trains the same model from the same initial weights on the same packed batches: a small
Qwen2.5-VL-layout model (hidden 512, 4 decoder layers, vocabulary 4096; `--quick`: the tiny one) learns a
fixed random bigram language in which every token has `--branching` equally likely successors, so the loss
falls from ln(vocab) towards ln(branching) (reported as `loss_floor`) within a few hundred steps. The
training path is the SFT job's: `convert_to_fp8` before FSDP2 sharding (bf16 mixed precision, fp32 master
weights), `TokenLogprobModel`, fused AdamW with warmup, gradient clipping at 1.

Reported per fp8 variant, against bf16: the largest per-step |loss difference| (`max_abs_diff`), the
difference of the mean losses of the last 10 steps (`final_abs_diff`), and whether that stays within
`--tolerance` (default 0.05 nats; per-step differences are mostly batch-to-batch noise of the two runs'
diverging weights, the final one is what fp8 training costs).

    python benchmarks/e2e/fp8_loss_curve.py --json fp8_loss.json      # GPU (sm89+): 300 steps, < 90 s on an H100
    python benchmarks/e2e/fp8_loss_curve.py --quick                   # CPU smoke test (tiny model, emulated fp8)
Args: --steps N --tokens N --samples N --lr X --branching N --variants bf16,tensorwise,rowwise --tolerance X --json PATH
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import tiny_config  # noqa: E402

from megatron_vlm.data.batch import shifted_labels  # noqa: E402
from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import build_mesh, clip_grad_norm_, init_distributed  # noqa: E402
from megatron_vlm.training.fp8 import convert_to_fp8  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.optim import build_optimizer  # noqa: E402

VARIANTS = ("bf16", "tensorwise", "rowwise")


def small_config(vocab: int = 4096) -> dict:
    """A small Qwen2.5-VL-layout model (text hidden 512, 4 layers); the vision tower is tiny and unused."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                         bos_token_id=None, eos_token_id=1, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=512, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


class BigramLanguage:
    """Token sequences of a fixed random bigram chain over the ids below `n` (the vision tokens sit above):
    each token has `branching` successors drawn once, each followed with equal probability."""

    def __init__(self, n: int, branching: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.n, self.branching = n, branching
        self.successors = [torch.randperm(n, generator=g)[:branching].tolist() for _ in range(n)]
        self._packs: dict = {}

    def pack(self, step: int, tokens: int, samples: int) -> dict:
        """The packed batch of `step` (the same for every variant; built once, on the CPU)."""
        if step in self._packs:
            return self._packs[step]
        g = torch.Generator().manual_seed(10_000 + step)
        per = tokens // samples
        starts = torch.randint(self.n, (samples,), generator=g).tolist()
        choices = torch.randint(self.branching, (samples, per - 1), generator=g).tolist()
        ids = []
        for start, row in zip(starts, choices):
            tok = start
            ids.append(tok)
            for c in row:
                tok = self.successors[tok][c]
                ids.append(tok)
        ids = torch.tensor(ids)
        cu = torch.arange(0, samples + 1, dtype=torch.int32) * per
        train = torch.ones_like(ids, dtype=torch.bool)
        train[cu[:-1].long()] = False  # nothing predicts a sequence's first token
        self._packs[step] = {"input_ids": ids[None], "labels": shifted_labels(ids, train, cu)[None], "cu_seqlens": cu}
        return self._packs[step]


def train_curve(variant: str, cfg: dict, data: BigramLanguage, args, env) -> list[float]:
    device = env.device
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    if variant != "bf16":
        convert_to_fp8(model, variant, device)
    wrapper = TokenLogprobModel(model)
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=False, reshard_after_forward=True)
    dims, mesh = build_mesh(parallel, env.world_size, device.type)
    get_family(model.hf_config.get("model_type")).parallelize(model, dims, parallel, mesh=mesh, param_dtype=torch.bfloat16,
                                                              root=wrapper, activation_checkpointing=False)
    optimizer = build_optimizer(wrapper, SimpleNamespace(lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8),
                                device.type)
    return run_steps(wrapper, optimizer, data, args, device)


def run_steps(wrapper, optimizer, data: BigramLanguage, args, device) -> list[float]:
    """`args.steps` steps of the SFT job's path (linear warmup over the first fifteenth, clipping at 1) on `data`'s
    packs; the loss of each step (shared by the loss-curve scripts)."""
    warmup = max(1, args.steps // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    params = [p for p in wrapper.parameters() if p.requires_grad]
    losses = []
    for step in range(args.steps):
        batch = {k: v.to(device) for k, v in data.pack(step, args.tokens, args.samples).items()}
        n = int((batch["labels"] != -100).sum())
        loss = -wrapper(batch).sum(dtype=torch.float32) / n
        loss.backward()
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def compare_curves(curves: dict[str, list[float]], base: str, tolerance: float) -> dict[str, dict]:
    """Each curve against `curves[base]`: first and last-10 mean losses, the largest per-step |difference|, the
    difference of the last-10 means and whether it is within `tolerance`; printed as a table."""
    ref = curves[base]
    last = min(10, len(ref))
    results: dict[str, dict] = {base: {"first_loss": ref[0], "final_loss": statistics.mean(ref[-last:])}}
    for v, c in curves.items():
        if v == base:
            continue
        final = abs(statistics.mean(c[-last:]) - statistics.mean(ref[-last:]))
        results[v] = {"first_loss": c[0], "final_loss": statistics.mean(c[-last:]),
                      "max_abs_diff": max(abs(a - b) for a, b in zip(c, ref)), "final_abs_diff": final,
                      "within_tolerance": bool(math.isfinite(final) and final <= tolerance)}
    print(f"{'variant':13s} {'first':>8s} {'final':>8s} {'max|d|':>8s} {'final|d|':>9s}")
    for v, r in results.items():
        print(f"{v:13s} {r['first_loss']:8.4f} {r['final_loss']:8.4f} {r.get('max_abs_diff', 0.0):8.4f} "
              f"{r.get('final_abs_diff', 0.0):9.4f}" + ("" if v == base else f"  within {tolerance}: {r['within_tolerance']}"))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 20 steps, on the CPU with emulated fp8 (smoke test)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per packed batch")
    ap.add_argument("--samples", type=int, default=8, help="sequences per pack")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--branching", type=int, default=4, help="successors per token of the bigram language")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="bf16 plus any of tensorwise,rowwise")
    ap.add_argument("--tolerance", type=float, default=0.05, help="bound on final_abs_diff (nats)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if "bf16" not in variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: bf16 plus a subset of {','.join(VARIANTS[1:])}")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:  # before any model is built: one line, no traceback
        print("skipped: torchao is not installed (pip install 'megatron-vlm[fp8]'): the fp8 variants need it")
        return
    env = init_distributed()
    if env.device.type == "cuda" and torch.cuda.get_device_capability(env.device) < (8, 9):
        sys.exit(f"fp8_loss_curve: {torch.cuda.get_device_name(env.device)} has no float8 matmuls (compute capability < 8.9)")
    if args.quick:
        torch.set_num_threads(1)
        cfg = tiny_config()
        args.steps, args.tokens, args.samples = min(args.steps, 20), min(args.tokens, 256), min(args.samples, 4)
    else:
        cfg = small_config()
    vocab = cfg["text_config"]["vocab_size"]
    special = min(cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))
    data = BigramLanguage(min(vocab, special), args.branching)
    t0 = time.perf_counter()
    curves = {v: train_curve(v, cfg, data, args, env) for v in variants}
    wall = time.perf_counter() - t0
    results = compare_curves(curves, "bf16", args.tolerance)
    meta = {"device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu (1 thread)",
            "torch": torch.__version__, "quick": args.quick, "steps": args.steps, "tokens": args.tokens,
            "samples": args.samples, "lr": args.lr, "hidden": cfg["text_config"]["hidden_size"],
            "layers": cfg["text_config"]["num_hidden_layers"], "vocab": vocab, "branching": args.branching,
            "loss_floor": math.log(args.branching), "tolerance": args.tolerance, "wall_s": wall,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "curves": curves}, indent=2))


if __name__ == "__main__":
    main()
