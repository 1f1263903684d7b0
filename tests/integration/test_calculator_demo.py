"""The calculator tool demo end to end, shrunk (demo_calculator_sft.toml -> demo_calculator_grpo.toml and the
no-tool arm): the tool-use traces teach a tiny Qwen2 the `<tool_call>` format, GRPO with `[rl.env] name =
"calculator"` then runs conversations in which the model's calls are parsed and answered by the tool, and the
no-tool arm runs the same recipe single-turn. Whether the tool raises reward is measured by the full demo
(megatron_vlm/rl/README.md), too long for CI; here only what holds for any seed: both arms finish, the tool arm's
conversations carry parsed tool calls and go past turn 1, the metrics are logged."""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job

from megatron_vlm.rl.env.calculator_data import write_synthetic_calculator

pytestmark = pytest.mark.heavy

CONFIGS = REPO / "launch" / "configs"
GRPO_STEPS = 2


def _sets(d: dict) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


def _run_arm(tmp_path, paths, tool: bool) -> list[dict]:
    arm = "" if tool else "_no_tool"
    sft, grpo = tmp_path / f"sft{arm}", tmp_path / f"grpo{arm}"
    # 16 questions, 40 steps: the tool arm writes <tool_call> blocks (well-formed or not); the no-tool arm only runs
    run_job(_sets({"model.path": f'"{tmp_path / "model"}"', "train.output_dir": f'"{sft}"',
                   "data.train_path": f'"{paths["sft_tool" if tool else "sft_direct"]}"', "data.num_workers": "0",
                   "train.max_steps": "40" if tool else "4", "optimizer.lr": "3e-3", "scheduler.warmup_steps": "5",
                   "checkpoint.every_steps": "0", "logging.tensorboard": "false"}),
            config=CONFIGS / f"demo_calculator_sft{arm}.toml")
    assert (sft / "hf" / "config.json").is_file()
    run_job(_sets({"model.path": f'"{sft / "hf"}"', "train.output_dir": f'"{grpo}"',
                   "data.train_path": f'"{paths["train"]}"', "train.max_steps": str(GRPO_STEPS),
                   "checkpoint.enable": "false", "checkpoint.export_hf": "false", "logging.tensorboard": "false",
                   "rl.batch.prompts_per_step": "2", "rl.batch.group_size": "4"}),
            config=CONFIGS / f"demo_calculator_grpo{arm}.toml")
    rows = read_metrics(grpo / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, GRPO_STEPS + 1))
    for key in ("reward/mean", "accuracy", "loss", "grad_norm"):
        assert any(key in c for c in rows[0]), (key, sorted(rows[0]))
    return rows


def test_calculator_demo_both_arms_run_and_the_tool_is_called(tmp_path):
    paths = write_synthetic_calculator(tmp_path / "data", low=10, high=13, eval_size=0, test_size=0)
    rows = _run_arm(tmp_path, paths, tool=True)
    for key in ("env/turns_mean", "env/tool_calls", "env/tool_errors", "env/errors", "env/finish_done"):
        assert key in rows[0], key
    assert all(float(r["env/errors"]) == 0 for r in rows)
    calls = sum(float(r["env/tool_calls"]) for r in rows)
    assert calls > 0  # the model wrote <tool_call> blocks and they were parsed (ran, or answered with an error)
    assert 0 <= sum(float(r["env/tool_errors"]) for r in rows) <= calls
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0  # the tool's reply was answered by another turn
    rows = _run_arm(tmp_path, paths, tool=False)
    assert not any(c.startswith("env/") for c in rows[0])  # the same recipe, single-turn
