"""REINFORCE++ through the entry point (the GRPO demo, tiny random Qwen2.5-VL, synthetic VQA prompts):

- `reinforce_plus_plus` with one completion per prompt and the KL penalty in the reward (a reference model,
  kl_coef > 0), on 2 data-parallel ranks: the job finishes with a finite loss and gradient norm, advantages
  whitened over the step (std 1) and the reward's KL logged;
- `reinforce_plus_plus_baseline` (groups of 4, KL in the loss) in asynchronous GRPO (one rollout rank, one
  training rank): the same, its advantages normalised on the training rank;
- the baseline variant with one completion per prompt exits 2 naming rl.batch.group_size."""
from __future__ import annotations

import math

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # two jobs of ~15-30 s; the unit tests run in CI

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
TINY = {"train.max_steps": "2", "checkpoint.enable": "false", "checkpoint.export_hf": "false", "rl.eval.at_start": "false",
        "rl.eval.max_prompts": "2", "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1",
        "rl.reward_pool.workers": "1", "rl.loss.kl_estimator": '"k1"'}


def _finite(rows, *keys):
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss", "grad_norm", "advantage/std", *keys):
            assert key in r and math.isfinite(float(r[key])), (key, r.get(key))
        assert float(r["advantage/std"]) == pytest.approx(1.0, rel=1e-3) or float(r["advantage/std"]) == 0.0
    assert any(float(r["grad_norm"]) > 0 for r in rows)


def test_reinforce_pp_with_one_completion_per_prompt_on_two_ranks(tmp_path):
    out = tmp_path / "rpp"
    run_job(grpo_overrides(out, tmp_path / "assets", **{**TINY, "rl.advantage": '"reinforce_plus_plus"',
                                                        "rl.batch.group_size": "1", "rl.batch.prompts_per_step": "8",
                                                        "rl.loss.kl_coef": "0.05"}),
            config=GRPO_DEMO, nproc=2)
    _finite(read_metrics(out / "metrics_train.csv"), "advantage/kl_in_reward")


def test_reinforce_pp_baseline_in_asynchronous_grpo(tmp_path):
    out = tmp_path / "async"
    run_job(grpo_overrides(out, tmp_path / "assets", **{**TINY, "rl.advantage": '"reinforce_plus_plus_baseline"',
                                                        "rl.allocation": '"rollout:1+train:1"', "rl.loss.kl_coef": "0.05",
                                                        "rl.recompute_logprobs": "false"}),
            config=GRPO_DEMO, nproc=2)
    _finite(read_metrics(out / "metrics_train.csv"), "actor/kl")


def test_the_baseline_variant_with_one_completion_exits_2(tmp_path):
    r = run_job(grpo_overrides(tmp_path / "out", tmp_path / "assets",
                               **{**TINY, "rl.advantage": '"reinforce_plus_plus_baseline"', "rl.batch.group_size": "1"}),
                config=GRPO_DEMO, check=False)
    assert r.returncode == 2 and "rl.batch.group_size: 1 " in r.stderr, r.stderr[-3000:]
