"""GRPO step time: ours vs TRL's `GRPOTrainer` on the same tiny Qwen2 model, weights and prompts.

Why: TRL is the usual baseline for GRPO; the figure to beat is the wall time of one step (generate
G completions per prompt, reward, group advantages, policy-gradient update). Setup: a tiny Qwen2
folder (`testing.tiny_text_model`, random weights) loaded by transformers (SDPA attention) for TRL
and by our loader for us; `--prompts` short arithmetic prompts tokenised by the folder's tokenizer
for both; `--group` completions per prompt of exactly `--new-tokens` tokens (TRL: `min_new_tokens`
in its generation kwargs; ours: no EOS token), temperature 1; a stand-in reward (a hash of the
completion scores 1 for about one completion in three, so ~4 % of groups have equal rewards, advantage 0,
which our update does not forward by default, `rl.update.skip_zero_advantage`; `--skip-zero-advantage off`
forwards them as TRL does; no reward workers); no KL term (TRL's default
beta = 0); one optimizer step per generation round (TRL: `steps_per_generation = 1`, `num_iterations
= 1`). Each framework runs its default path: TRL `model.generate` on padded prompts; ours the
rollout engine (prefix sharing, slot KV cache, continuous batching) and the real `GRPOStep` (one fp32
process: plain parameters, as a job runs; `--fsdp on`: FSDP2 units on a one-rank mesh). `--rollout-weights copy` (default, `rl.rollout.weights = "copy"`): the engine
decodes with its own unsharded copy, refreshed from the trainer's weights once per step (included in
the step time); `shared`: every decode step runs through the FSDP root.

Timing: rounds interleaved in one process — a TRL `TrainerCallback` times each TRL step
(`on_step_begin` -> `on_step_end`, generation included) and then runs and times one of our steps —
so both see the same machine load; the first `--warmup` rounds are dropped; min and median printed.

    python benchmarks/trl_grpo.py             # needs `pip install trl`; prints "skipped: trl not installed" otherwise
    python benchmarks/trl_grpo.py --quick
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

from trl_interleave import interleave_callback  # noqa: E402


def make_prompts(n: int, seed: int = 0, tokenizer=None, prompt_tokens: int = 0) -> list[str]:
    """`n` short arithmetic questions; with `prompt_tokens` > 0 each is preceded by its own context of
    numbered facts, grown until the prompt has at least that many tokens (the seed GRPO recipes' prompts are a
    question plus an image: hundreds of tokens; the bare question is ~15)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(10, 1000, (n,), generator=g).tolist(), torch.randint(10, 1000, (n,), generator=g).tolist()
    prompts = [f"What is {x} plus {y}? Answer with a number." for x, y in zip(a, b)]
    if prompt_tokens <= 0:
        return prompts
    out = []
    for i, question in enumerate(prompts):
        facts: list[str] = []
        while len(tokenizer(" ".join(facts) + " " + question, add_special_tokens=False)["input_ids"]) < prompt_tokens:
            k = len(facts)
            facts.append(f"Fact {k}: box {(i * 31 + k * 7) % 97} holds {(i * 13 + k * 11) % 89} stones.")
        out.append(" ".join(facts) + " " + question)
    return out


def hash_reward(text: str) -> float:
    return float(zlib.crc32(text.encode()) % 3 == 0)


class OurGRPO:
    """Our synchronous GRPO step (`megatron_vlm.rl.grpo_step.GRPOStep`), wired as bench_grpo_step.py does."""

    def __init__(self, folder: Path, tokenizer, prompts: list[str], group: int, new_tokens: int, rollout_weights: str = "copy",
                 prompt_sharing: str = "auto", fsdp: str = "auto", skip_zero_advantage: bool = True):
        from bench_grpo_step import FixedPrompts, HashReward, TokenIds

        from megatron_vlm.checkpoint.hf import load_hf_model
        from megatron_vlm.inference.engine import RolloutPrompt
        from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
        from megatron_vlm.models import get_family
        from megatron_vlm.parallel import build_mesh, init_distributed
        from megatron_vlm.rl.config import RLBatchConfig, RLConfig, RLLossConfig, RLRolloutConfig, RLUpdateConfig
        from megatron_vlm.rl.grpo_step import GRPOStep
        from megatron_vlm.rl.prompts.dataset import PromptSample
        from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
        from megatron_vlm.training.lm_loss import TokenLogprobModel
        from megatron_vlm.training.optim import OptimState, build_optimizer, build_scheduler

        env = init_distributed()
        model = load_hf_model(str(folder), dtype=torch.float32, device="cpu")
        wrapper = TokenLogprobModel(model)
        parallel = SimpleNamespace(dp_replicate=1, dp_shard=-1, compile=False, reshard_after_forward=True)
        dims, mesh = build_mesh(parallel, env.world_size, "cpu")
        from megatron_vlm.training.model_bundle import fsdp_needed

        # as a job does: one fp32 process keeps plain parameters (fsdp "on": FSDP2 units anyway, for comparison)
        fsdp_mesh = mesh if fsdp == "on" or fsdp_needed(env.world_size, "fp32", "cpu") else None
        get_family(model.hf_config.get("model_type")).parallelize(model, dims, parallel, mesh=fsdp_mesh, root=wrapper)
        optimizer = build_optimizer(wrapper, SimpleNamespace(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8), "cpu")
        scheduler = build_scheduler(optimizer, SimpleNamespace(warmup_steps=0, warmup_ratio=0.0, type="constant", min_lr_ratio=0.0), 10**6)
        ctx = SimpleNamespace(
            env=env, cfg=SimpleNamespace(data=SimpleNamespace(max_tokens_per_pack=1 << 16), train=SimpleNamespace(seed=0, max_grad_norm=1.0)),
            to_device=lambda b: b,
        )
        bundle = SimpleNamespace(model=model, wrapper=wrapper, dims=dims, moe_balancer=None,
                                 trainable_params=[p for p in wrapper.parameters() if p.requires_grad])
        rl = RLConfig(batch=RLBatchConfig(group_size=group, prompts_per_step=len(prompts)),
                      rollout=RLRolloutConfig(max_new_tokens=new_tokens, temperature=1.0), loss=RLLossConfig(kl_coef=0.0),
                      update=RLUpdateConfig(prompt_sharing=prompt_sharing, skip_zero_advantage=skip_zero_advantage),
                      rewards=[ExactMatchRewardConfig()])
        rl.validate()
        if rollout_weights == "copy":  # as rl.rollout.weights = "copy": an unsharded copy, refreshed once per step
            policy_copy = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
            policy_copy.requires_grad_(False)
            engine = PolicyRolloutEngine(policy_copy, TokenIds(),
                                         EngineOptions(cache_dtype=torch.float32, device=env.device, eos_token_ids=[-1]),
                                         sync_from=model)
        else:  # "shared": the trainer's parameters, every decode step through the FSDP root
            engine = PolicyRolloutEngine(model, TokenIds(),
                                         EngineOptions(cache_dtype=torch.float32, device=env.device, eos_token_ids=[-1]),
                                         forward=lambda **kw: wrapper(model_kwargs=kw))
        encoded = [RolloutPrompt(torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"])) for p in prompts]
        self.runner = GRPOStep(ctx, bundle, OptimState(optimizer, scheduler), rl, engine, FixedPrompts(encoded), HashReward())
        self.batch = [PromptSample(str(i), [], "x", "q") for i in range(len(prompts))]
        self.n = 0
        self.skipped: list[float] = []  # zero-advantage completions our update did not forward, per step

    def step(self) -> float:
        t0 = time.perf_counter()
        metrics = self.runner.run(self.n, self.batch)
        dt = time.perf_counter() - t0
        self.skipped.append(metrics.get("train/zero_adv_skipped", 0.0))
        self.n += 1
        return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="grow each prompt to at least this many tokens with a context of facts (0: the bare ~15-token question)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rollout-weights", choices=("copy", "shared"), default="copy",
                    help="our engine's weights (rl.rollout.weights): its own copy (default) or the trainer's FSDP parameters")
    ap.add_argument("--prompt-sharing", choices=("auto", "off"), default="auto",
                    help="rl.update.prompt_sharing of our update (off: every completion's pack row carries its own prompt copy, as TRL's)")
    ap.add_argument("--skip-zero-advantage", choices=("on", "off"), default="on",
                    help="rl.update.skip_zero_advantage of our update (off: zero-advantage completions are forwarded too, as TRL's)")
    ap.add_argument("--fsdp", choices=("auto", "on"), default="auto",
                    help="our model's FSDP2 units: as a job (auto: none for one fp32 process) or always (on)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("skipped: trl not installed (pip install trl)")
        return 0
    if args.quick:
        args.rounds, args.warmup = 2, 1
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_DISABLED", "true")
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    tmp = Path(tempfile.mkdtemp(prefix="trl_grpo_bench_"))
    folder = build_tiny_qwen_text_folder(tmp / "tiny-qwen2", model_type="qwen2", hidden=args.hidden, layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    prompts = make_prompts(args.prompts, tokenizer=tokenizer, prompt_tokens=args.prompt_tokens)
    prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    ours = OurGRPO(folder, tokenizer, prompts, args.group, args.new_tokens, args.rollout_weights, args.prompt_sharing,
                   fsdp=args.fsdp, skip_zero_advantage=args.skip_zero_advantage == "on")

    steps = args.warmup + args.rounds
    times = {"trl": [], "ours": []}

    interleave = interleave_callback(times, ours.step)

    def reward(completions, **kw):
        return [hash_reward(c if isinstance(c, str) else str(c)) for c in completions]

    config = GRPOConfig(
        output_dir=str(tmp / "trl_out"), per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, beta=0.0, max_steps=steps,
        max_completion_length=args.new_tokens, temperature=1.0, learning_rate=1e-6, max_grad_norm=1.0,
        logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, generation_kwargs={"min_new_tokens": args.new_tokens},
    )
    dataset = Dataset.from_list([{"prompt": p} for p in prompts] * steps)
    trainer = GRPOTrainer(model=hf_model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[interleave])
    trainer.train()
    rows = []
    for name, v in times.items():
        v = v[args.warmup:]
        rows.append({"name": name, "min_s": min(v), "median_s": statistics.median(v)})
    ratio_median, ratio_min = rows[0]["median_s"] / rows[1]["median_s"], rows[0]["min_s"] / rows[1]["min_s"]
    print(f"{'':6s} {'min s':>9s} {'median s':>9s}")
    for r in rows:
        print(f"{r['name']:6s} {r['min_s']:9.3f} {r['median_s']:9.3f}")
    print(f"TRL / ours step time: x{ratio_median:.2f} (median), x{ratio_min:.2f} (min)  [target >= 2]")
    skipped = ours.skipped[args.warmup:]
    print(f"ours: zero-advantage completions not forwarded (rl.update.skip_zero_advantage = {args.skip_zero_advantage}): "
          f"{sum(skipped) / max(1, len(skipped)):.1f} of {args.prompts * args.group} per step on average")
    meta = {"device": f"cpu ({args.threads} thread(s))", "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
            "prompt_tokens_mean": round(statistics.mean(prompt_lengths), 1),
            "hidden": args.hidden, "layers": args.layers, "rounds": args.rounds, "rollout_weights": args.rollout_weights,
            "prompt_sharing": args.prompt_sharing, "fsdp": args.fsdp, "skip_zero_advantage": args.skip_zero_advantage,
            "zero_adv_skipped_mean": round(sum(skipped) / max(1, len(skipped)), 2),
            "load_avg": round(os.getloadavg()[0], 1), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "ratio_median": ratio_median,
                                               "ratio_min": ratio_min}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
