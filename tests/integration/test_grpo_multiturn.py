"""Whole multi-turn GRPO jobs through the entry point ([rl.env]: a tiny random Qwen2.5-VL talking to an
environment that answers turn 1 with a new image): the env/* metrics are reported, trajectories have more than
one turn, and a run killed with SIGKILL mid-run and resumed repeats the uninterrupted one exactly (metrics and
exported weights)."""
from __future__ import annotations

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

ENV = '{name = "tests.integration.grpo_env_fns:ShowImage", max_turns = 3, turn_timeout_s = 60.0}'


def multiturn_overrides(out, assets, **extra):
    sets = {"rl.env": ENV, "rl.rollout.weights": '"copy"', "rl.rollout.stop": '["e", "a", "o"]',
            "data.max_tokens_per_pack": "200", "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1"}
    sets.update(extra)
    return grpo_overrides(out, assets, **sets)


def test_multiturn_grpo_job_and_exact_resume_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(multiturn_overrides(straight, assets), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for key in ("env/turns_mean", "env/errors", "env/finish_done", "env/tokens_mean", "reward/mean", "loss"):
        assert key in rows[0], key
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0  # conversations went past turn 1
    assert all(float(r["env/errors"]) == 0 for r in rows)
    assert float(rows[0]["grad_norm"]) > 0

    r = run_job(multiturn_overrides(crashed, assets), config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"},
                check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    r = run_job(multiturn_overrides(crashed, assets), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows:
        for key in ("reward/mean", "loss", "env/turns_mean", "env/tokens_mean", "grad_norm"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def test_environment_reward_only_job(tmp_path):
    """No [[rl.rewards]] verifier: the trajectory's reward and the accuracy, in training and in the held-out
    evaluation, are the environment's turn rewards (reward/env)."""
    out = tmp_path / "env_only"
    sets = {"rl.rewards": "[]", "rl.accuracy_reward": '"env"', "train.max_steps": "2", "rl.eval.every_steps": "2"}
    run_job(multiturn_overrides(out, tmp_path / "assets", **sets), config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(float(r["reward/mean"]) == float(r["reward/env"]) > 0 for r in rows)
    assert all("accuracy" in r for r in rows)
    evals = read_metrics(out / "metrics_eval.csv")
    assert evals and all(0.0 <= float(r["accuracy"]) <= 1.0 for r in evals), evals
