"""One synchronous GRPO step, phase by phase: rollout, reward, reference log-probs, update.

Runs the real step (`megatron_vlm.rl.grpo_step.GRPOStep`) on a Qwen2.5-VL model with random weights
wrapped as in a training job (`TokenLogprobModel` under FSDP2 on a one-rank mesh, bf16 parameters on
GPU), prompts with random images, and a stand-in reward (a hash of the completion, so groups have
non-zero advantages without reward worker processes). Reported per step (median over `--steps`
after one warm-up step): seconds per phase, generated tokens/s, trained tokens/s, and the share of
the step spent generating.

    python benchmarks/e2e/bench_grpo_step.py                 # GPU, 3B shape, 8 prompts x G=8, 512 new tokens
    python benchmarks/e2e/bench_grpo_step.py --quick         # CPU smoke test (tiny model)
    python benchmarks/e2e/bench_grpo_step.py --steps 1 --prompts 2 --group 4 --new-tokens 64   # a GPU lease's size

`--prompts`, `--group` and `--new-tokens` override the shape (defaults above); the shape measured is in
the JSON's `meta` and printed first, so a lease-sized step is not mistaken for the default one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import NoDecode, make_prompts, positive_int, qwen2_5_vl_3b_config, tiny_config  # noqa: E402

from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models import build_model, get_family  # noqa: E402
from megatron_vlm.parallel import build_mesh, init_distributed  # noqa: E402
from megatron_vlm.rl.config import RLBatchConfig, RLConfig, RLLossConfig, RLRolloutConfig  # noqa: E402
from megatron_vlm.rl.grpo_step import GRPOStep  # noqa: E402
from megatron_vlm.rl.prompts.dataset import PromptSample  # noqa: E402
from megatron_vlm.rl.reference import ReferencePolicy  # noqa: E402
from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig  # noqa: E402
from megatron_vlm.rl.rewards.manager import RewardBatch  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.optim import OptimState, build_optimizer, build_scheduler  # noqa: E402


class HashReward:
    """Stand-in for RewardManager: reward 1 for about a third of the completions (by content hash)."""

    labels = ["exact_match"]

    def score(self, completions, answers, prompts=None, metadata=None, *, only=None):
        values = [float(zlib.crc32(",".join(map(str, c)).encode()) % 3 == 0) for c in completions]
        return RewardBatch(total=values, per_reward={"exact_match": values})

    def metrics(self):
        return {}


class FixedPrompts:
    """Stand-in for PromptEncoder: PromptSample i -> the i-th pre-built RolloutPrompt."""

    skipped = 0

    def __init__(self, prompts):
        self.prompts = prompts

    def encode(self, sample):
        return self.prompts[int(sample.prompt_id)]


class TokenIds(NoDecode):
    def decode(self, ids, skip_special_tokens=False):  # the reward hashes the token ids
        return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--kl", type=float, default=0.0, help="rl.loss.kl_coef (> 0 adds the reference model)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; --quick 4)")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt G (default 8; --quick 4)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per completion (default 512; --quick 16)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    env = init_distributed()
    device = env.device
    if args.quick:
        torch.set_num_threads(1)
        cfg, grid, text_tokens, n_prompts, group, new_tokens, max_tokens = tiny_config(), (1, 8, 8), 24, 4, 4, 16, 512
        param_dtype = None
    else:
        cfg, grid, text_tokens, n_prompts, group, new_tokens, max_tokens = qwen2_5_vl_3b_config(), (1, 56, 64), 104, 8, 8, 512, 16384
        param_dtype = torch.bfloat16
    for flag, value in (("--prompts", args.prompts), ("--group", args.group), ("--new-tokens", args.new_tokens)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    n_prompts, group, new_tokens = args.prompts or n_prompts, args.group or group, args.new_tokens or new_tokens
    print(f"shape: {n_prompts} prompts x G {group} x {new_tokens} new tokens, {args.steps} timed step(s)", flush=True)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    model.init_weights()
    wrapper = TokenLogprobModel(model)
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=False, reshard_after_forward=True)
    dims, mesh = build_mesh(parallel, env.world_size, device.type)
    get_family(model.hf_config.get("model_type")).parallelize(model, dims, parallel, mesh=mesh, param_dtype=param_dtype,
                                                              root=wrapper)
    optimizer = build_optimizer(wrapper, SimpleNamespace(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8), device.type)
    scheduler = build_scheduler(optimizer, SimpleNamespace(warmup_steps=0, warmup_ratio=0.0, type="constant", min_lr_ratio=0.0), 100)
    ctx = SimpleNamespace(
        env=env, cfg=SimpleNamespace(data=SimpleNamespace(max_tokens_per_pack=max_tokens), train=SimpleNamespace(seed=0, max_grad_norm=1.0)),
        to_device=lambda b: {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()},
    )
    bundle = SimpleNamespace(model=model, wrapper=wrapper, dims=dims, moe_balancer=None,
                             trainable_params=[p for p in wrapper.parameters() if p.requires_grad])
    rl = RLConfig(batch=RLBatchConfig(group_size=group, prompts_per_step=n_prompts),
                  rollout=RLRolloutConfig(max_new_tokens=new_tokens, temperature=1.0), loss=RLLossConfig(kl_coef=args.kl),
                  rewards=[ExactMatchRewardConfig()])
    rl.validate()
    compute_dtype = param_dtype or torch.float32
    engine = PolicyRolloutEngine(model, TokenIds(),
                                 EngineOptions(cache_dtype=compute_dtype, device=device, eos_token_ids=[-1]),
                                 forward=lambda **kw: wrapper(model_kwargs=kw))
    reference = None
    if args.kl > 0:
        ref_model = build_model(cfg, dtype=compute_dtype, device="cpu")
        ref_model.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()})
        reference = ReferencePolicy(ref_model, device=device, offload=False, temperature=1.0)
    prompts = make_prompts(n_prompts, grid, text_tokens, cfg, seed=1)
    step_runner = GRPOStep(ctx, bundle, OptimState(optimizer, scheduler), rl, engine, FixedPrompts(prompts), HashReward(), reference)
    batch = [PromptSample(str(i), [], "x", "q") for i in range(n_prompts)]
    rows = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        m = step_runner.run(step, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        m["wall_s"] = time.perf_counter() - t0
        if step > 0:  # the first step warms up (allocator, kernels)
            rows.append(m)
    keys = ["wall_s", "time/rollout_s", "time/reward_s", "time/ref_s", "time/train_s", "perf/rollout_tokens_per_s",
            "perf/train_tokens_per_s"]
    summary = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    summary["rollout_share"] = summary["time/rollout_s"] / summary["wall_s"]
    if device.type == "cuda":
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for k, v in summary.items():
        print(f"{k:28s} {v:12.3f}")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (1 thread)", "torch": torch.__version__,
            "quick": args.quick, "prompts": n_prompts, "group": group, "new_tokens": new_tokens, "prompt_tokens": len(prompts[0]),
            "kl": args.kl, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
