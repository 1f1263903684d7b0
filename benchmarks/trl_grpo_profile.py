"""Where the time and the FLOPs of one GRPO step go: ours vs TRL's `GRPOTrainer`, per phase.

Why: `trl_grpo.py` gives the ratio of whole steps; this script says what each step is made of, so a
claim such as "the ceiling is ~x1.75" can be checked against numbers. Same setup as `trl_grpo.py`
(tiny Qwen2 folder, same prompts, G, new tokens, loss, one optimizer step, 1 thread). Per phase it
reports the CPU time of the process (`time.process_time`: less sensitive than wall time to other jobs on
a shared machine) as the median over the measured steps, and the FLOPs of one extra step counted by
`torch.utils.flop_counter.FlopCounterMode` (matmuls and attention; elementwise work is not counted).
Phases: ours = the rollout engine's `generate` and the step's `PolicyUpdate.update` (forward, backward, optimizer);
TRL = `_generate` (its `model.generate` call) and the rest of the trainer step (loss forward, backward
with TRL's default gradient checkpointing, optimizer, scoring).

    python benchmarks/trl_grpo_profile.py                # both, 6 measured steps after 2 warm-up steps
    python benchmarks/trl_grpo_profile.py --only ours --ops   # + a torch.profiler table of our update and rollout
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class PhaseClock:
    """CPU seconds per call of wrapped functions, and FLOPs of the calls made while `counting`."""

    def __init__(self):
        self.cpu: dict[str, list[float]] = {}
        self.flops: dict[str, int] = {}
        self.counting = False

    def wrap(self, name: str, fn):
        from torch.utils.flop_counter import FlopCounterMode

        def wrapped(*a, **kw):
            if self.counting:
                with FlopCounterMode(display=False) as fc:
                    out = fn(*a, **kw)
                self.flops[name] = self.flops.get(name, 0) + fc.get_total_flops()
                return out
            t0 = time.process_time()
            out = fn(*a, **kw)
            self.cpu.setdefault(name, []).append(time.process_time() - t0)
            return out
        return wrapped

    def report(self, title: str, warmup: int) -> None:
        print(f"{title}: CPU s per step (median of {len(self.cpu['step']) - warmup}), GFLOP per step")
        for name, v in self.cpu.items():
            v = v[warmup:]
            print(f"  {name:10s} {statistics.median(v):7.3f} s (min {min(v):.3f})   {self.flops.get(name, 0) / 1e9:7.2f} GFLOP")


def profile_ours(folder, tokenizer, prompts, args) -> None:
    from trl_grpo import OurGRPO

    ours = OurGRPO(folder, tokenizer, prompts, args.group, args.new_tokens)
    clock = PhaseClock()
    engine, policy = ours.runner.engine, ours.runner.policy  # the step's two public parts
    engine.generate = clock.wrap("rollout", engine.generate)
    policy.update = clock.wrap("update", policy.update)
    ours.runner.run = clock.wrap("step", ours.runner.run)
    for _ in range(args.warmup + args.steps):
        ours.step()
    clock.counting = True
    ours.step()
    clock.counting = False
    clock.report("ours", args.warmup)
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        for name, owner, attr in (("update", policy, "update"), ("rollout", engine, "generate")):
            inner = getattr(owner, attr)

            def traced(*a, _inner=inner, _name=name, **kw):
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    out = _inner(*a, **kw)
                print(f"--- {_name}: ops by self CPU time (wall clock of each op)")
                print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25,
                                                                        max_name_column_width=40, max_shapes_column_width=60))
                return out
            setattr(owner, attr, traced)
        ours.step()


def profile_trl(folder, tokenizer, prompts, args) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl_grpo import hash_reward

    clock = PhaseClock()
    steps = args.warmup + args.steps + 1
    counted = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock.counting = state.global_step == steps - 1
            if clock.counting:
                from torch.utils.flop_counter import FlopCounterMode
                counted["mode"] = FlopCounterMode(display=False)
                counted["mode"].__enter__()
            self.t0 = time.process_time()

        def on_step_end(self, a, state, control, **kw):
            if clock.counting:
                counted["mode"].__exit__(None, None, None)
                clock.flops["step"] = counted["mode"].get_total_flops()
                clock.counting = False
            else:
                clock.cpu.setdefault("step", []).append(time.process_time() - self.t0)

    def reward(completions, **kw):
        return [hash_reward(c if isinstance(c, str) else str(c)) for c in completions]

    tmp = Path(tempfile.mkdtemp(prefix="trl_grpo_profile_"))
    config = GRPOConfig(
        output_dir=str(tmp), per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, beta=0.0, max_steps=steps,
        max_completion_length=args.new_tokens, temperature=1.0, learning_rate=1e-6, max_grad_norm=1.0,
        logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, generation_kwargs={"min_new_tokens": args.new_tokens},
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts] * steps),
                          processing_class=tokenizer, callbacks=[Clock()])
    generate = trainer._generate

    def timed_generate(*a, **kw):  # inside the step's counter when counting: its FLOPs are read off a nested one
        if clock.counting:
            from torch.utils.flop_counter import FlopCounterMode
            with FlopCounterMode(display=False) as fc:
                out = generate(*a, **kw)
            clock.flops["rollout"] = fc.get_total_flops()
            return out
        t0 = time.process_time()
        out = generate(*a, **kw)
        clock.cpu.setdefault("rollout", []).append(time.process_time() - t0)
        return out
    trainer._generate = timed_generate
    trainer.train()
    clock.cpu["rest"] = [s - g for s, g in zip(clock.cpu["step"], clock.cpu["rollout"])]
    clock.flops["rest"] = clock.flops.get("step", 0) - clock.flops.get("rollout", 0)
    clock.report(f"TRL {config.gradient_checkpointing=}", args.warmup)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("ours", "trl"), default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ops", action="store_true", help="also a torch.profiler op table of our update and rollout")
    args = ap.parse_args()
    if args.only != "ours" and importlib.util.find_spec("trl") is None:
        print("skipped: trl not installed (pip install trl)")
        return 0
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_DISABLED", "true")
    from transformers import AutoTokenizer
    from trl_grpo import make_prompts

    from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder

    folder = build_tiny_qwen_text_folder(Path(tempfile.mkdtemp(prefix="trl_grpo_profile_")) / "tiny-qwen2", model_type="qwen2",
                                         hidden=256, layers=4)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = make_prompts(args.prompts, tokenizer=tokenizer)
    if args.only in (None, "ours"):
        profile_ours(folder, tokenizer, prompts, args)
    if args.only in (None, "trl"):
        profile_trl(folder, tokenizer, prompts, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
