"""Multi-turn GRPO ([rl.env]) in the asynchronous loop: one rollout rank + one training rank (2 processes, gloo,
tiny random Qwen2.5-VL, an environment that answers turn 1 with a new image).

With max_head_offpolicyness = 0 the rollout rank's conversations are the synchronous loop's (the same seed per
step and rank, the weights of the same version), so the run repeats the synchronous multi-turn run exactly: the
same rewards (verifiers + the environment's turn rewards), losses, gradient norms, trajectory lengths and turn
counts at every step. With max_head_offpolicyness = 1 the rollout runs ahead within the bound (heavy)."""
from __future__ import annotations

import pytest
from jobs import read_metrics, run_job
from test_grpo_job import GRPO_DEMO
from test_grpo_multiturn import multiturn_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two jobs of two and one processes, ~1.5-2 min here

COMPARED = ("reward/mean", "loss", "grad_norm", "response_length/mean", "advantage/std", "env/turns_mean",
            "env/tokens_mean", "env/model_tokens_mean", "env/errors")


def _sets(out, assets, **extra):
    base = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.eval.at_start": "false",
            "rl.eval.every_steps": "0", "train.max_steps": "3", "checkpoint.export_hf": "false",
            "checkpoint.enable": "false", "rl.reward_pool.workers": "1"}
    base.update(extra)
    return multiturn_overrides(out, assets, **base)


def test_async_multiturn_offpolicyness_0_equals_sync(tmp_path):
    assets = tmp_path / "assets"
    run_job(_sets(tmp_path / "sync", assets), config=GRPO_DEMO)
    want = read_metrics(tmp_path / "sync" / "metrics_train.csv")
    assert [int(r["step"]) for r in want] == [1, 2, 3] and float(want[0]["grad_norm"]) > 0
    assert max(float(r["env/turns_mean"]) for r in want) > 1.0  # conversations went past turn 1
    run_job(_sets(tmp_path / "async", assets, **{"rl.allocation": '"rollout:1+train:1"'}), nproc=2, config=GRPO_DEMO)
    got = {int(x["step"]): x for x in read_metrics(tmp_path / "async" / "metrics_train.csv")}
    assert sorted(got) == [1, 2, 3]
    for row in want:
        step = int(row["step"])
        for key in COMPARED:
            assert float(got[step][key]) == float(row[key]), (step, key, got[step][key], row[key])
        assert float(got[step]["async/version_lag_max"]) == 0.0


def test_async_multiturn_runs_ahead_within_the_bound(tmp_path):
    out = tmp_path / "run"
    run_job(_sets(out, tmp_path / "assets", **{"rl.allocation": '"rollout:1+train:1"', "train.max_steps": "4",
                                               "rl.asynchronous.max_head_offpolicyness": "1",
                                               "rl.loss.behav_imp_weight_cap": "5.0"}), nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(float(r["async/version_lag_max"]) <= 1.0 and float(r["env/errors"]) == 0 for r in rows)
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0
