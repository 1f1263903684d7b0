"""GRPO jobs with a learned reward model (launch/configs/demo_grpo_reward_model.toml) end to end: two processes
each score their completions with their own copy of a scalar-head VLM (rewards in (0, 1) through the sigmoid,
no failures); and a reward model whose head is NaN is a counted zero reward on every call, not a crash (the
job ends normally, `reward/errors` counts every model call)."""
from __future__ import annotations

import pytest
import torch
from jobs import REPO, read_metrics, run_job

pytestmark = pytest.mark.distributed

CONFIG = REPO / "launch" / "configs" / "demo_grpo_reward_model.toml"
STEPS = 2


def _reward_model(policy, out, *, nan: bool):
    from megatron_vlm.rl.rewards.score_model import save_score_model
    from megatron_vlm.testing.reward_model_vqa import score_model_from_causal

    model = score_model_from_causal(policy, seed=1)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
        if nan:
            model.score.weight[0, 0] = float("nan")
    return save_score_model(model, out, copy_from=policy)


def _run(tmp_path, name: str, rm, nproc: int):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(CONFIG.read_text().replace('path = "runs/demo_reward_model/hf"', f'path = "{rm}"'))
    out = tmp_path / name
    run_job([f"{k}={v}" for k, v in {
        "model.path": f'"{tmp_path / "policy"}"', "data.synthetic_dir": f'"{tmp_path / "data"}"',
        "data.synthetic_train_size": "64", "data.synthetic_eval_size": "8", "train.output_dir": f'"{out}"',
        "train.max_steps": str(STEPS), "checkpoint.enable": "false", "checkpoint.export_hf": "false",
        "logging.tensorboard": "false", "rl.eval.at_start": "false", "rl.eval.every_steps": "0",
        "rl.batch.prompts_per_step": "4",
    }.items()], nproc=nproc, config=cfg)
    return read_metrics(out / "metrics_train.csv")


@pytest.mark.heavy  # two GRPO jobs, ~1-2 min
def test_grpo_with_a_reward_model_and_a_nan_reward_model(tmp_path):
    from megatron_vlm.testing.tiny_model import build_tiny_model_folder

    policy = build_tiny_model_folder("tiny_qwen2_5_vl", tmp_path / "policy", seed=0)
    rows = _run(tmp_path, "good", _reward_model(policy, tmp_path / "rm", nan=False), nproc=2)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert 0.0 < float(r["reward/reward_model"]) < 1.0
        assert float(r["reward/errors"]) == 0.0
    assert float(rows[-1]["reward/calls"]) > 0

    rows = _run(tmp_path, "nan", _reward_model(policy, tmp_path / "rm_nan", nan=True), nproc=1)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    last, completions = rows[-1], STEPS * 4 * 8  # steps x prompts x G; the weight-0 exact-match rule is called too
    assert float(last["reward/errors"]) == completions and float(last["reward/calls"]) == 2 * completions
    assert all(float(r["reward/reward_model"]) == 0.0 for r in rows)
