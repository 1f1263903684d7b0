"""GRPO that learns the synthetic VQA task from a learned reward model alone (no rule reward in the loss).

Three stages (`--only` runs one; an SFT stage is skipped when its export exists):

1. `sft`: the GRPO demo's start, 100 steps of demo_sft.toml (runs/demo_sft_short/hf), as the demo's first command;
   with `--rm-init full` also the whole SFT demo (600 steps, runs/demo_sft/hf), the reward model's start;
2. `reward-model`: reward-model training as a user runs it (`[train] mode = "reward"`,
   launch/configs/demo_reward_model.toml, the Bradley-Terry loss): a scalar head on an SFT checkpoint's backbone
   (`--rm-init short`: the policy's own 100-step start; `full`: the 600-step SFT demo, as reward models usually start
   from a stronger SFT model than the policy), trained on preference JSONL files of the train split's correct vs
   wrong answers (megatron_vlm/testing/reward_model_vqa.py: vqa_pairs); its held-out pair accuracy (correct scored
   above wrong) before and after from the run's metrics_eval.csv; exported to runs/demo_reward_model/hf;
3. `grpo`: launch/configs/demo_grpo_reward_model.toml (the demo with `[[rl.rewards]] type = "model"`, the
   exact-match rule at weight 0 only for the accuracy), the held-out accuracy from metrics_eval.csv.

    python benchmarks/reward_model_grpo.py [--rm-init full] [--rm-steps 400] [--grpo-steps 150] [--only reward-model]
        [--negatives 3] [--kl-coef 0.1] [--rm-path runs/demo_reward_model_x/hf] [--tag kl0.1]

`--negatives N` trains the reward model on N wrong answers per training question (N draws of vqa_pairs, more hard
negatives; `--rm-steps` optimizer steps of ~12 pairs, one 1024-token pack); `--kl-coef` sets rl.loss.kl_coef (a KL penalty to the SFT start); `--rm-path` points GRPO at an
existing reward model folder; `--tag` suffixes the output folders and the results file.

Results go to runs/reward_model_grpo.json (and the log); the figures are in megatron_vlm/rl/README.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT = REPO / "runs" / "demo_sft_short"
SFT_FULL = REPO / "runs" / "demo_sft"
RM = REPO / "runs" / "demo_reward_model"
GRPO = REPO / "runs" / "demo_grpo_reward_model"
DATA = REPO / "runs" / "demo_assets" / "synthetic_vqa"
RESULTS = REPO / "runs" / "reward_model_grpo.json"


def _launch(args: list[str], nproc: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable])
    subprocess.run(cmd + [str(REPO / "launch" / "pretrain_vlm.py"), *args], cwd=REPO, env=env, check=True)


def stage_sft(nproc: int, full: bool) -> None:
    for out, steps in ((SFT, 100), *(((SFT_FULL, 600),) if full else ())):
        if (out / "hf" / "config.json").is_file():
            print(f"sft: {out / 'hf'} exists")
            continue
        _launch(["--config", "launch/configs/demo_sft.toml", "--set", f"train.output_dir={out.relative_to(REPO)}",
                 "--set", f"train.max_steps={steps}"], nproc)


def stage_reward_model(steps: int, init: Path, malformed: float, negatives: int, results: dict) -> None:
    """The reward model through the product path (`[train] mode = "reward"`, launch/configs/demo_reward_model.toml):
    preference JSONL files of the synthetic set's questions (the right answer chosen, a vqa_pairs wrong answer
    rejected; `negatives` draws per training question), trained from `init`'s causal export with a fresh head;
    the held-out pair accuracy before (step 0) and after from the run's metrics_eval.csv."""
    from megatron_vlm.testing.reward_model_vqa import vqa_pairs, write_preference_jsonl

    pairs = RM / "pairs"
    train = [p for s in range(negatives) for p in vqa_pairs(DATA / "train.jsonl", seed=s, malformed=malformed)]
    held = vqa_pairs(DATA / "eval.jsonl", seed=1, malformed=malformed)
    write_preference_jsonl(train, pairs / "train.jsonl")
    write_preference_jsonl(held, pairs / "eval.jsonl")
    t0 = time.perf_counter()
    sets = {"model.path": f'"{(init / "hf").relative_to(REPO)}"', "data.type": '"messages_jsonl"',
            "data.train_path": f'"{(pairs / "train.jsonl").relative_to(REPO)}"',
            "data.eval_path": f'"{(pairs / "eval.jsonl").relative_to(REPO)}"', "train.output_dir": f'"{RM.relative_to(REPO)}"',
            "train.max_steps": steps, "train.eval_every": 0, "checkpoint.resume": '"none"', "checkpoint.every_steps": 0}
    _launch(["--config", "launch/configs/demo_reward_model.toml", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
            nproc=1)
    ev = {int(r["step"]): r for r in csv.DictReader((RM / "metrics_eval.csv").open())}
    tr = list(csv.DictReader((RM / "metrics_train.csv").open()))
    loss = [float(r["loss"]) for r in tr if r.get("loss")]
    results["reward_model"] = {"init": str(init.relative_to(REPO)), "malformed": malformed, "negatives": negatives,
                               "train_pairs": len(train), "steps": steps, "loss": "bradley_terry",
                               "train_seconds": round(time.perf_counter() - t0, 1),
                               "loss_first_logged": loss[0] if loss else None, "loss_last_logged": loss[-1] if loss else None,
                               "heldout_pair_accuracy_before": float(ev[0]["accuracy"]),
                               "heldout_pair_accuracy_after": float(ev[max(ev)]["accuracy"]), "heldout_pairs": len(held)}
    print("reward model:", results["reward_model"], flush=True)


def _rewards(rm_path: str) -> str:
    """`--set rl.rewards=[...]`: the demo config's two reward entries with the reward model at `rm_path`."""
    return ('rl.rewards=[{type = "model", name = "reward_model", path = "' + rm_path + '", activation = "sigmoid", '
            'batch_size = 64}, {type = "exact_match", weight = 0.0}]')


def stage_grpo(steps: int, nproc: int, kl_coef: float, rm_path: str, results: dict) -> None:
    _launch(["--config", "launch/configs/demo_grpo_reward_model.toml", "--set", f"train.max_steps={steps}",
             "--set", f"train.output_dir={GRPO.relative_to(REPO)}", "--set", f"rl.loss.kl_coef={kl_coef}",
             "--set", _rewards(rm_path or str((RM / "hf").relative_to(REPO)))], nproc)
    rows = list(csv.DictReader((GRPO / "metrics_eval.csv").open()))
    results["grpo"] = {"steps": steps, "kl_coef": kl_coef, "reward_model": rm_path or str(RM / "hf"), "heldout_accuracy": {r["step"]: float(r["accuracy"]) for r in rows}}
    train = list(csv.DictReader((GRPO / "metrics_train.csv").open()))

    def mean(key: str, part: list) -> float:
        vals = [float(r[key]) for r in part if r.get(key) not in (None, "")]
        return sum(vals) / max(len(vals), 1)

    for key in ("reward/exact_match", "reward/reward_model", "reward/errors"):
        results["grpo"][f"{key} steps 1-20"] = mean(key, train[:20])
        results["grpo"][f"{key} last 20"] = mean(key, train[-20:])
    print("grpo:", results["grpo"], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["sft", "reward-model", "grpo"])
    ap.add_argument("--rm-steps", type=int, default=400)
    ap.add_argument("--grpo-steps", type=int, default=150)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rm-init", choices=["short", "full"], default="short")
    ap.add_argument("--malformed", type=float, default=0.0,
                    help="share of wrong answers that are an answer followed by more words (vqa_pairs)")
    ap.add_argument("--negatives", type=int, default=1, help="wrong answers per training question (reward model)")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="rl.loss.kl_coef of the GRPO stage")
    ap.add_argument("--rm-path", default="", help="reward model folder for the GRPO stage (default: the one trained here)")
    ap.add_argument("--tag", default="", help="suffix of the reward model / GRPO folders and the results file")
    a = ap.parse_args()
    global RM, GRPO, RESULTS
    if a.tag:
        RM, GRPO = RM.with_name(f"{RM.name}_{a.tag}"), GRPO.with_name(f"{GRPO.name}_{a.tag}")
        RESULTS = RESULTS.with_name(f"{RESULTS.stem}_{a.tag}.json")
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if a.only in (None, "sft"):
        stage_sft(a.nproc, a.rm_init == "full")
    if a.only in (None, "reward-model"):
        stage_reward_model(a.rm_steps, SFT_FULL if a.rm_init == "full" else SFT, a.malformed, a.negatives, results)
        RESULTS.write_text(json.dumps(results, indent=2))
    if a.only in (None, "grpo"):
        stage_grpo(a.grpo_steps, a.nproc, a.kl_coef, a.rm_path, results)
        RESULTS.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
