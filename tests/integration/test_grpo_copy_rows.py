"""The GRPO job of test_grpo_job.py in bf16 logs the same rows with rl.rollout.weights = "copy" as with "shared".

Why: synchronous GRPO generates each step's rollouts with the weights after the previous step's update in both modes,
with the same sampler and engine code; the copy only holds those weights on its own. It once computed without the
trainer's bf16 input casts (its q / k rotation in fp32: behaviour log-probs ~1e-3 off the trainer's), so the rows
parted from step 2 while step 1's tokens happened to match. The engine-level comparison is
tests/unit/rl/test_rollout_copy_casts.py."""
from __future__ import annotations

import pytest
from jobs import read_metrics, run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

KEYS = ("loss", "grad_norm", "reward/mean", "rollout/logprob_abs_diff", "rollout/mismatch_kl", "actor/kl")


@pytest.mark.heavy
def test_copy_and_shared_rows_equal_in_bf16(tmp_path):
    assets = tmp_path / "assets"
    rows = {}
    for weights in ("shared", "copy"):
        out = tmp_path / weights
        run_job(grpo_overrides(out, assets, **{"train.precision": '"bf16"', "parallel.fsdp": "false",
                                               "train.max_steps": "3", "checkpoint.every_steps": "0",
                                               "rl.rollout.weights": f'"{weights}"'}), config=GRPO_DEMO)
        rows[weights] = [{k: r[k] for k in KEYS} for r in read_metrics(out / "metrics_train.csv")]
    assert len(rows["shared"]) == 3
    assert rows["copy"] == rows["shared"]
