"""The zoom tool demo end to end, shrunk (demo_zoom_sft.toml -> demo_zoom_grpo.toml and the no-tool arm): the
tool-use traces teach the tiny Qwen2.5-VL to call `zoom`, GRPO with `[rl.env] name = "zoom"` then runs
conversations in which the call is parsed, the crop comes back as an image in the next turn (through the vision
tower) and the model answers after it; the no-tool arm runs the same recipe single-turn. Whether zooming raises
accuracy is measured by the full demo (megatron_vlm/rl/README.md), too long for CI; here what holds for any seed:
both arms finish, the tool arm's conversations carry valid calls, returned images and more than one turn."""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job

from megatron_vlm.rl.env.zoom_data import write_synthetic_zoom

pytestmark = pytest.mark.heavy

CONFIGS = REPO / "launch" / "configs"
GRPO_STEPS = 2


def _sets(d: dict) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


def _run_arm(tmp_path, paths, tool: bool) -> list[dict]:
    arm = "" if tool else "_no_tool"
    sft, grpo = tmp_path / f"sft{arm}", tmp_path / f"grpo{arm}"
    # 10 images, 60 steps: the tool arm learns the (constant) zoom call (30 steps were too few: no valid call);
    # the no-tool arm only runs
    run_job(_sets({"model.path": f'"{tmp_path / "model"}"', "train.output_dir": f'"{sft}"',
                   "data.train_path": f'"{paths["sft_tool" if tool else "sft_direct"]}"', "data.num_workers": "0",
                   "data.max_tokens_per_pack": "2048", "train.max_steps": "60" if tool else "3", "optimizer.lr": "3e-3",
                   "scheduler.warmup_steps": "5", "checkpoint.every_steps": "0", "logging.tensorboard": "false"}),
            config=CONFIGS / f"demo_zoom_sft{arm}.toml")
    assert (sft / "hf" / "config.json").is_file()
    run_job(_sets({"model.path": f'"{sft / "hf"}"', "train.output_dir": f'"{grpo}"',
                   "data.train_path": f'"{paths["eval"]}"', "train.max_steps": str(GRPO_STEPS),
                   "checkpoint.enable": "false", "checkpoint.export_hf": "false", "logging.tensorboard": "false",
                   "rl.batch.prompts_per_step": "2", "rl.batch.group_size": "4",
                   "rl.rollout.temperature": "0.5"}),  # mostly well-formed calls from the short SFT
            config=CONFIGS / f"demo_zoom_grpo{arm}.toml")
    rows = read_metrics(grpo / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, GRPO_STEPS + 1))
    for key in ("reward/mean", "accuracy", "loss", "grad_norm"):
        assert any(key in c for c in rows[0]), (key, sorted(rows[0]))
    return rows


def test_zoom_demo_both_arms_run_and_images_come_back(tmp_path):
    paths = write_synthetic_zoom(tmp_path / "data", n_train=10, n_eval=4, n_test=0)
    rows = _run_arm(tmp_path, paths, tool=True)
    for key in ("env/turns_mean", "env/tool_calls", "env/tool_errors", "env/tool_images", "env/errors"):
        assert key in rows[0], key
    assert all(float(r["env/errors"]) == 0 for r in rows)  # no environment / observation failure
    calls = sum(float(r["env/tool_calls"]) for r in rows)
    valid = calls - sum(float(r["env/tool_errors"]) for r in rows)
    assert valid > 0  # zoom calls that parsed and ran
    assert sum(float(r["env/tool_images"]) for r in rows) == valid  # each valid zoom returned its crop as an image
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0  # the crop was answered by another model turn
    rows = _run_arm(tmp_path, paths, tool=False)
    assert not any(c.startswith("env/") for c in rows[0])  # the same recipe, single-turn
