"""Reward-model step time: ours (`[train] mode = "reward"`) vs TRL's `RewardTrainer` on the same tiny Qwen2 model,
head weights and pairs.

Why: TRL's `RewardTrainer` is what users would otherwise run to train a Bradley-Terry reward model; the figure to
beat is the wall time of one optimizer step (forward and backward over chosen and rejected, clip, AdamW) at
equal data. Setup as `trl_dpo.py` (its helpers): a tiny Qwen2 folder (random weights); TRL trains transformers'
`Qwen2ForSequenceClassification` loaded from it (`num_labels = 1`, SDPA attention), we train our `ScoreRoot`
(the family backbone and a scalar head) built by `build_reward_bundle` as a job does; the score head's weights are
copied from ours into TRL's, so both start from the same model. `--pairs` pairs of random token ids (prompt +
chosen, prompt + rejected), the same ids for both (TRL takes pre-tokenised `chosen_ids` / `rejected_ids` as they
are). Loss -log sigmoid(r_chosen - r_rejected), no margin, no centring (both defaults). Each framework runs its
default path: TRL pads the 2 x pairs rows of [chosen; rejected] (its collator), gradient checkpointing on (its
default); ours one packed varlen forward of every pair's chosen and rejected, their prompt computed once
(`RewardStep`; `--prompt-sharing off`: the prompt in both sequences), one fp32 CPU process
with plain parameters as a job (`--fsdp on`: FSDP2 units on a one-rank mesh anyway). Both fp32, gradient
clipping at 1.0, their default AdamW, lr 1e-4 (TRL's reward default). The first steps' losses are printed side
by side (the same model and data: equal to float tolerance).

Timing: rounds interleaved in one process (a TRL `TrainerCallback` times each TRL step and then runs and times
one of ours); the first `--warmup` rounds dropped; min and median printed with the ratio.

    python benchmarks/trl_reward.py          # needs `pip install trl`; prints "skipped: trl not installed" otherwise
    python benchmarks/trl_reward.py --quick
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_dpo import (  # noqa: E402
    OurPairJob,
    _NoMetrics,
    _SamePack,
    common_args,
    finish,
    force_fsdp,
    interleave,
    our_context,
    pair_pack,
    setup,
)


def build_our_reward(folder: Path, out_dir: Path, pairs: list[dict], *, lr: float, fsdp: bool,
                     prompt_sharing: str = "auto") -> OurPairJob:
    from megatron_vlm.training.optim import build_optim_state
    from megatron_vlm.training.reward.build import build_reward_bundle, reward_section
    from megatron_vlm.training.reward.step import RewardStep

    ctx = our_context(folder, out_dir, "reward", lr, {})
    force_fsdp(fsdp)
    reward = reward_section(ctx.cfg)
    bundle = build_reward_bundle(ctx, reward)
    pack = pair_pack(pairs)
    optim = build_optim_state(bundle.wrapper, ctx.cfg, "cpu", 10**6)
    step = RewardStep(ctx, bundle, optim, _NoMetrics(), _SamePack(pack), reward=reward)
    job = OurPairJob(step, pack, prompt_sharing)
    job.head = bundle.wrapper.score.weight  # type: ignore[attr-defined]
    return job


def main() -> int:
    ap = common_args(__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("skipped: trl not installed (pip install trl)")
        return 0
    tmp, folder, tokenizer, pairs = setup(args, "trl_reward_bench_")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    ours = build_our_reward(folder, tmp, pairs, lr=args.lr, fsdp=args.fsdp == "on", prompt_sharing=args.prompt_sharing)
    hf_model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32,
                                                                   attn_implementation="sdpa")
    with torch.no_grad():  # the same fresh head on both sides
        head = ours.head.detach()
        hf_model.score.weight.copy_(head.full_tensor() if hasattr(head, "full_tensor") else head)
    steps = args.warmup + args.rounds
    trl_first: list[dict] = []

    class RecordingRewardTrainer(RewardTrainer):
        """TRL's trainer with the first steps' loss recorded for the check."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if len(trl_first) < 3 and model.training:
                m = self._metrics["train"]
                trl_first.append({"loss": float((out[0] if return_outputs else out).detach()),
                                  "margin": m["margin"][-1], "accuracy": m["accuracy"][-1]})
            return out

    config = RewardConfig(
        output_dir=str(tmp / "trl_out"), per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1,
        max_steps=steps, learning_rate=args.lr, max_grad_norm=1.0, logging_steps=10**6, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        max_length=None, lr_scheduler_type="constant", train_sampling_strategy="sequential",
    )
    rows = [{"chosen_ids": p["prompt_ids"] + p["chosen_ids"], "rejected_ids": p["prompt_ids"] + p["rejected_ids"]}
            for p in pairs]
    dataset = Dataset.from_list(rows * steps)  # in order: every step's batch is the same pairs as ours

    def factory(callback):
        return RecordingRewardTrainer(model=hf_model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                      callbacks=[callback])

    times = interleave(factory, ours)
    print("first steps (TRL | ours):")
    for k, (t, o) in enumerate(zip(trl_first, ours.metrics)):
        print(f"  step {k + 1}: loss {t['loss']:.7f} | {o['loss']:.7f}   margin {t['margin']:.6f} | {o['margin']:.6f}"
              f"   accuracy {t['accuracy']:.3f} | {o['accuracy']:.3f}")
    return finish(args, pairs, ours, times, trl_first, {"lr": args.lr})


if __name__ == "__main__":
    sys.exit(main())
