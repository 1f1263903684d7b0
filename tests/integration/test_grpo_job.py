"""Whole GRPO jobs through the entry point (tiny random Qwen2.5-VL, synthetic VQA prompts): the run
folder holds every metric the GRPO-with-FSDP math recipe reports (reward, accuracy, length, clip fraction, KL,
entropy, advantage, throughput, phase times, loss, grad norm), held-out accuracy before the first and after the last step, a
checkpoint and an HF export; a run killed with SIGKILL and resumed repeats the uninterrupted run
exactly — with the reference model (KL), recomputed old log-probs, 2 PPO epochs x 2 mini-batches
and sequence-mean loss all active."""
from __future__ import annotations

import pytest
from jobs import REPO, as_overrides, load_safetensors_dir, read_metrics, run_job, run_job_here

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"

RECIPE_METRICS = (
    "reward/mean", "reward/std", "reward/min", "reward/max", "accuracy", "response_length/mean",
    "actor/clip_frac", "actor/kl", "actor/entropy", "advantage/mean", "advantage/std", "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s", "time/rollout_s", "time/reward_s", "time/train_s", "loss", "grad_norm", "lr",
)


def grpo_overrides(out, assets, **extra) -> list[str]:
    sets = {
        "model.path": f'"{assets / "model"}"',
        "model.synthesize": '"tiny_qwen2_5_vl"',
        "data.synthetic_dir": f'"{assets / "data"}"',
        "data.synthetic_train_size": "32",
        "data.synthetic_eval_size": "4",
        "data.max_tokens_per_pack": "160",
        "train.output_dir": f'"{out}"',
        "train.max_steps": "4",
        "logging.tensorboard": "false",
        "checkpoint.every_steps": "2",
        "checkpoint.keep_last": "0",
        "optimizer.lr": "0.01",
        "rl.batch.group_size": "4",
        "rl.batch.prompts_per_step": "4",
        "rl.rollout.max_new_tokens": "6",
        "rl.batch.ppo_epochs": "2",
        "rl.batch.mini_batches_per_step": "2",
        "rl.loss.loss_agg": '"seq-mean"',
        "rl.loss.kl_coef": "0.05",
        "rl.recompute_logprobs": "true",
        "rl.model_path_hint": '""',
        "rl.rewards": '[{type = "custom", function = "tests.integration.grpo_reward_fns.text_length", kwargs = {cap = 40}}, '
                      '{type = "exact_match", weight = 0.0}]',
        "rl.accuracy_reward": '"exact_match"',
        "rl.eval.every_steps": "0",
        "rl.eval.max_new_tokens": "3",
    }
    return as_overrides(sets, extra)


def test_grpo_run_folder_and_exact_resume_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job_here(grpo_overrides(straight, assets), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for key in RECIPE_METRICS:
        assert key in rows[0] and float(rows[0][key]) == float(rows[0][key]), key  # present, not NaN
    assert float(rows[0]["reward/std"]) > 0 and float(rows[0]["grad_norm"]) > 0  # a real update happened
    evals = read_metrics(straight / "metrics_eval.csv")
    assert [int(r["step"]) for r in evals] == [0, 4] and "avg@1" in evals[0] and "pass@1" in evals[0]
    assert (straight / "checkpoints" / "step_4" / "COMPLETE").is_file()
    assert (straight / "hf" / "config.json").is_file()

    r = run_job(grpo_overrides(crashed, assets), config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"},
                check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert (crashed / "checkpoints" / "step_2" / "COMPLETE").is_file()
    r = run_job_here(grpo_overrides(crashed, assets), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows:
        # reward/calls counts since the start of the run: the resumed process continues the checkpoint's total
        for key in ("reward/mean", "loss", "actor/kl", "response_length/mean", "grad_norm", "reward/calls"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
