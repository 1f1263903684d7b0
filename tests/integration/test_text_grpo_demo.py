"""Smoke run of the text-only math demo (demo_math_sft.toml -> demo_math_grpo.toml), two processes,
a few steps each: the tiny Qwen2 is synthesised, the arithmetic parquet read through the `hf`
path, SFT exports a folder GRPO starts from, and every metric the math GRPO recipe reports is
logged for a text-only run (reward mean / std, accuracy, response length, clip fraction, KL,
entropy, grad norm), together with the held-out evaluation's accuracy. Whether GRPO raises
held-out accuracy is measured by the full demo (docs/text_models.md), too long for CI."""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job

from megatron_vlm.data.synthetic_arith import write_synthetic_arith

pytestmark = pytest.mark.distributed

SFT = REPO / "launch" / "configs" / "demo_math_sft.toml"
GRPO = REPO / "launch" / "configs" / "demo_math_grpo.toml"
GRPO_STEPS = 3


def _sets(d: dict) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


@pytest.mark.heavy
def test_text_math_demo_runs_and_logs_the_recipe_metrics(tmp_path):
    paths = write_synthetic_arith(tmp_path / "data", max_operand=9, eval_size=8)
    data = {"data.train_path": f'"{paths["train"]}"', "data.eval_path": f'"{paths["eval"]}"',
            "data.max_tokens_per_pack": "256", "logging.tensorboard": "false"}
    run_job(_sets({**data, "data.num_workers": "0", "model.path": f'"{tmp_path / "model"}"', "train.output_dir": f'"{tmp_path / "sft"}"',
                   "train.max_steps": "4", "train.eval_every": "0", "checkpoint.every_steps": "0"}), nproc=2, config=SFT)
    assert (tmp_path / "sft" / "hf" / "config.json").is_file()
    run_job(_sets({**data, "model.path": f'"{tmp_path / "sft" / "hf"}"', "train.output_dir": f'"{tmp_path / "grpo"}"',
                   "train.max_steps": str(GRPO_STEPS), "checkpoint.enable": "false", "checkpoint.export_hf": "false",
                   "rl.batch.prompts_per_step": "4", "rl.batch.group_size": "4", "rl.eval.every_steps": "0"}), nproc=2, config=GRPO)
    rows = read_metrics(tmp_path / "grpo" / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, GRPO_STEPS + 1))
    columns = set(rows[0])
    for needle in ("reward/mean", "reward/std", "accuracy", "response_length", "clip", "kl", "entropy", "grad_norm"):
        assert any(needle in c for c in columns), (needle, sorted(columns))
    evals = read_metrics(tmp_path / "grpo" / "metrics_eval.csv")
    assert evals and 0.0 <= float(evals[0]["accuracy"]) <= 1.0
