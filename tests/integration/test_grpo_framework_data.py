"""A whole GRPO job (launch/pretrain_vlm.py, tiny random Qwen2.5-VL) whose prompts are a verl-format parquet
read as verl's geo3k preprocessing writes it, with `data.type = "hf"` and no column mapping: the layout is
detected, a bad row is left out and counted, and the run trains and evaluates on the rest."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from jobs import REPO, read_metrics, run_job_here

from tests.fixtures.framework_prompt_tables import verl_table, write_verl_geo3k

pytestmark = pytest.mark.distributed  # a whole job in one process, ~8 s on a 2-core CPU


def test_grpo_job_from_a_verl_parquet(tmp_path):
    from test_grpo_job import grpo_overrides

    data = tmp_path / "data"
    train = write_verl_geo3k(data, n=6)
    test = write_verl_geo3k(data, n=2, split="test")
    rows = pq.read_table(train).to_pylist()
    rows[5]["reward_model"]["ground_truth"] = None  # no reference: left out at start-up, counted
    verl_table([{k: r[k] for k in ("data_source", "prompt", "images", "ability", "reward_model", "extra_info")}
                for r in rows], train)
    out = tmp_path / "run"
    overrides = [o for o in grpo_overrides(out, tmp_path / "assets", **{
        "train.max_steps": 1, "rl.batch.prompts_per_step": 2, "rl.batch.group_size": 2, "rl.batch.mini_batches_per_step": 1,
        "rl.batch.ppo_epochs": 1, "checkpoint.every_steps": 1, "rl.loss.kl_coef": 0.0, "rl.recompute_logprobs": "false",
        "rl.eval.max_new_tokens": 2, "rl.rollout.max_new_tokens": 3}) if not o.startswith("data.synthetic")]
    overrides += ['data.type="hf"', f'data.train_path="{train}"', f'data.eval_path="{test}"', "data.max_tokens_per_pack=256"]
    r = run_job_here(overrides, check=False, config=REPO / "launch" / "configs" / "demo_grpo.toml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(row["step"]) for row in read_metrics(out / "metrics_train.csv")] == [1]
    assert [int(row["step"]) for row in read_metrics(out / "metrics_eval.csv")] == [0, 1]
    bad = json.loads((out / "bad_records.json").read_text())
    assert bad["by_category"] == {"invalid_record": 1}
    assert [rec["index"] for rec in bad["records"]] == [5]
