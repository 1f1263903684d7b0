"""Our DPO / reward-model step on image preference pairs, each pair's prompt computed once vs twice (CPU).

Why: `benchmarks/trl_dpo.py` measures the text case against TRL; for a VLM the prompt holds the image, so the
plain pack runs the vision tower and the image tokens twice per pair (chosen and rejected). Setup: the tiny
Qwen2.5-VL folder of the demos (random weights), the synthetic VQA preference pairs of `data.type =
"synthetic_vqa"` at `--image-size` pixels, one pack of `--pack-tokens` from the preference loader; the real
`DPOStep` (sigmoid, beta 0.1, on-the-fly frozen reference) or `RewardStep` as a job builds them (one fp32 CPU
process), the projector and language model trained, the vision tower frozen as in the demos (`--train-vision`:
everything trained). Rounds alternate shared / plain on the same step object; min and median printed.

    python benchmarks/pair_prompts_vlm.py [--trainer reward] [--image-size 224]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", choices=("dpo", "reward"), default="dpo")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--pack-tokens", type=int, default=4096)
    ap.add_argument("--train-vision", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_vlm.config import load_config_dict
    from megatron_vlm.data.preference_loader import build_preference_dataloader
    from megatron_vlm.parallel import init_distributed
    from megatron_vlm.testing.synthesize import synthesize_model_folder
    from megatron_vlm.training.context import RunContext
    from megatron_vlm.training.optim import build_optim_state

    tmp = Path(tempfile.mkdtemp(prefix="pair_prompts_vlm_"))
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "model", seed=0)
    raw = {"model": {"path": str(folder)},
           "data": {"type": "synthetic_vqa", "synthetic_dir": str(tmp / "data"), "synthetic_train_size": 64,
                    "synthetic_eval_size": 0, "synthetic_image_size": args.image_size,
                    "max_tokens_per_pack": args.pack_tokens, "num_workers": 0},
           "train": {"mode": args.trainer, "output_dir": str(tmp / "run"), "seed": 0, "max_steps": 10**6,
                     "precision": "fp32",
                     "train_layers": [".*"] if args.train_vision else ["^visual\\.merger\\.", "^language_model\\."]},
           "optimizer": {"lr": 1e-6, "weight_decay": 0.0}, "scheduler": {"type": "constant"}}
    if args.trainer == "dpo":
        raw["dpo"] = {"beta": 0.1, "reference": "on_the_fly"}
    cfg = load_config_dict(raw)
    ctx = RunContext(cfg=cfg, env=init_distributed(), run_dir=Path(cfg.train.output_dir))
    from trl_dpo import _NoMetrics, _SamePack

    if args.trainer == "dpo":
        from megatron_vlm.training.dpo.build import build_reference, dpo_section
        from megatron_vlm.training.dpo.step import DPOStep
        from megatron_vlm.training.model_bundle import build_model_bundle

        bundle = build_model_bundle(ctx)
    else:
        from megatron_vlm.training.reward.build import build_reward_bundle, reward_section
        from megatron_vlm.training.reward.step import RewardStep

        bundle = build_reward_bundle(ctx, reward_section(cfg))
    pack = next(iter(build_preference_dataloader(cfg.data, bundle.processor, seed=0, dp_rank=0, dp_size=1)))
    pack.pop("_meta", None)
    loader = _SamePack(pack)
    optim = build_optim_state(bundle.wrapper, cfg, "cpu", 10**6)
    if args.trainer == "dpo":
        dpo = dpo_section(cfg)
        step = DPOStep(ctx, bundle, optim, _NoMetrics(), loader, dpo=dpo,
                       reference=build_reference(ctx, bundle, dpo, loader, None))
    else:
        step = RewardStep(ctx, bundle, optim, _NoMetrics(), loader, reward=reward_section(cfg))
    assert step.share_prompts, "the tiny Qwen2.5-VL shares prompts"
    tokens = {"plain": int(pack["input_ids"].numel()), "shared": int(step.prepared(pack)["input_ids"].numel())}
    times: dict[str, list[float]] = {"plain": [], "shared": []}
    for n in range(args.warmup + args.rounds):
        for name in ("plain", "shared"):
            step.share_prompts = name == "shared"
            t0 = time.perf_counter()
            step.train_step(n, log=False)
            if n >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    rows = {k: {"min_s": min(v), "median_s": statistics.median(v), "tokens": tokens[k]} for k, v in times.items()}
    print(f"{int(pack['num_pairs'])} pairs, {int(pack['image_grid_thw'].shape[0])} images in the plain pack")
    for k, r in rows.items():
        print(f"{k:7s} {r['tokens']:6d} tokens  min {r['min_s']:.3f} s  median {r['median_s']:.3f} s")
    print(f"plain / shared: x{rows['plain']['median_s'] / rows['shared']['median_s']:.2f} (median), "
          f"x{rows['plain']['min_s'] / rows['shared']['min_s']:.2f} (min)")
    meta = {"trainer": args.trainer, "image_size": args.image_size, "pairs": int(pack["num_pairs"]),
            "train_vision": args.train_vision, "torch": torch.__version__, "load_avg": round(os.getloadavg()[0], 1),
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
