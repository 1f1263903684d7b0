"""A whole GRPO job on a CUDA device with the default `rl.rollout.cuda_graphs` ("auto") against the same job with
eager decode steps ("off"): the rollout engine (its own fp32 weights copy) captures its decode steps and the job
trains as the eager one (rewards and lengths equal: the greedy-equivalent tokens of the engine's GPU test; losses and
gradient norms within 1e-4). Skipped without CUDA; the CPU runs of the same comparison use "on"
(tests/integration/test_grpo_cuda_graphs.py), where the static step runs eagerly and nothing is captured."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from jobs import REPO, read_metrics, run_job  # noqa: E402
from test_grpo_job import grpo_overrides  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"


def test_default_graphs_train_like_eager_steps(tmp_path):
    assets = tmp_path / "assets"
    rows, logs = {}, {}
    for mode in ("default", "off"):
        out = tmp_path / mode
        extra = {"rl.rollout.weights": '"copy"', "train.precision": '"fp32"', "train.max_steps": "2",
                 "rl.batch.ppo_epochs": "1", "rl.eval.at_start": "false", "checkpoint.export_hf": "false",
                 "checkpoint.every_steps": "0", "rl.reward_pool.workers": "1"}
        if mode == "off":
            extra["rl.rollout.cuda_graphs"] = '"off"'
        r = run_job(grpo_overrides(out, assets, **extra), config=GRPO_DEMO)
        rows[mode], logs[mode] = read_metrics(out / "metrics_train.csv"), r.stdout + r.stderr
    assert "rollout CUDA graphs auto" in logs["default"], logs["default"][-3000:]
    # "auto" falls back to eager steps with a warning when a capture fails: then nothing here ran in graphs
    assert "CUDA graphs off" not in logs["default"], logs["default"][-3000:]
    assert "rollout CUDA graphs" not in logs["off"]
    assert len(rows["default"]) == len(rows["off"]) == 2
    for a, b in zip(rows["off"], rows["default"]):
        for key in ("reward/mean", "response_length/mean"):
            assert float(a[key]) == float(b[key]), (a["step"], key)
        for key in ("loss", "grad_norm"):
            assert float(a[key]) == pytest.approx(float(b[key]), abs=1e-4), (a["step"], key)
