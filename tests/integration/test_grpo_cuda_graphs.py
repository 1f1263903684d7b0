"""`rl.rollout.cuda_graphs` through the entry point (one process, tiny random Qwen2.5-VL): a GRPO job whose
rollout engine decodes on the static CUDA-graph buffers ("on": run eagerly on the CPU, the capture is
the GPU test's) trains exactly as the same job with eager decode steps (rewards, losses, gradient norms,
lengths at every step), and "on" with the trainer's shared weights is a config error (exit 2)."""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # three jobs, ~45 s; the unit tests cover the engine

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
COMPARED = ("reward/mean", "loss", "grad_norm", "response_length/mean")


def test_static_decode_steps_train_like_eager_ones(tmp_path):
    assets = tmp_path / "assets"
    rows = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        run_job(grpo_overrides(out, assets, **{
            "rl.rollout.weights": '"copy"', "rl.rollout.cuda_graphs": f'"{mode}"', "train.max_steps": "2",
            "rl.batch.ppo_epochs": "1", "rl.eval.at_start": "false", "checkpoint.export_hf": "false",
            "checkpoint.every_steps": "0", "rl.reward_pool.workers": "1"}), config=GRPO_DEMO)
        rows[mode] = read_metrics(out / "metrics_train.csv")
    assert len(rows["on"]) == len(rows["off"]) == 2
    for a, b in zip(rows["off"], rows["on"]):
        for key in COMPARED:
            assert float(a[key]) == pytest.approx(float(b[key]), abs=1e-5), (a["step"], key)
    r = run_job(grpo_overrides(tmp_path / "shared", assets, **{"rl.rollout.cuda_graphs": '"on"'}), config=GRPO_DEMO,
                check=False)
    assert r.returncode == 2 and "rl.rollout.cuda_graphs" in r.stderr, r.stderr[-2000:]
