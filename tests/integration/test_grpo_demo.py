"""A much shorter version of the GRPO demo (launch/configs/demo_grpo.toml), fixed seeds, two processes:
the demo's 100-step SFT start (demo_sft.toml with max_steps = 100, on a smaller synthetic set: the
model has begun to answer with task words, sampled reward ~0.04), then 40 GRPO steps with the
exact-match reward at a higher learning rate than the demo's. The training reward must rise: the mean
of the last 10 steps beats the mean of the first 10 (GRPO learns which answers each question type
calls for). Measured with the continuous-batching engine (its inverse-CDF sampler draws other random
numbers than the previous engine's) for train.seed 0 / 1 / 2: 0.042 -> 0.070, 0.033 -> 0.163,
0.052 -> 0.125 (the previous engine: 0.044 -> 0.135, 0.038 -> 0.105, 0.051 -> 0.132); the test runs
seed 0, the weakest of the three, with a margin of 0.02."""
from __future__ import annotations

import pytest
from jobs import DEMO, REPO, read_metrics, run_job

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
SFT_STEPS = 100
GRPO_STEPS = 40
WINDOW = 10


@pytest.mark.heavy  # ~50 s; CI keeps the GRPO job tests (test_grpo_job.py)
def test_short_grpo_demo_raises_reward(tmp_path):
    assets, sft, grpo = tmp_path / "assets", tmp_path / "sft", tmp_path / "grpo"
    data = {"data.synthetic_dir": f'"{assets / "data"}"', "data.synthetic_train_size": "512", "data.synthetic_eval_size": "16"}
    run_job([f"{k}={v}" for k, v in {
        **data, "model.path": f'"{assets / "model"}"', "train.output_dir": f'"{sft}"', "train.max_steps": str(SFT_STEPS),
        "train.eval_every": "0", "train.eval_generate": "false", "checkpoint.every_steps": "0", "logging.tensorboard": "false",
        "data.num_workers": "0",
    }.items()], nproc=2, config=DEMO)
    run_job([f"{k}={v}" for k, v in {
        **data, "model.path": f'"{sft / "hf"}"', "train.output_dir": f'"{grpo}"', "train.max_steps": str(GRPO_STEPS),
        "checkpoint.enable": "false", "checkpoint.export_hf": "false", "logging.tensorboard": "false",
        "rl.eval.at_start": "false", "rl.eval.every_steps": "0", "rl.eval.max_prompts": "8",
        "rl.batch.prompts_per_step": "16", "optimizer.lr": "1e-3",
    }.items()], nproc=2, config=GRPO_DEMO)
    rows = read_metrics(grpo / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, GRPO_STEPS + 1))
    reward = [float(r["reward/mean"]) for r in rows]
    first, last = sum(reward[:WINDOW]) / WINDOW, sum(reward[-WINDOW:]) / WINDOW
    assert last >= first + 0.02, reward
