"""Each family's tiny CPU demo config trains through the entry point with falling loss; the
Nemotron-VL (MoE) demo reports the moe/* workload metrics and the per-layer expert-load table."""
from __future__ import annotations

import json

import pytest
from jobs import REPO, read_metrics, run_job

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("demo", ["demo_qwen3_vl", "demo_internvl", "demo_nemotron_vl",
                                  "demo_nemotron_qwen3_vision"])
def test_tiny_demo_trains(tmp_path, demo):
    out = tmp_path / "run"
    sets = {
        "model.path": f'"{tmp_path / "model"}"', "data.synthetic_dir": f'"{tmp_path / "data"}"',
        "data.synthetic_train_size": 96, "data.synthetic_eval_size": 4, "data.num_workers": 0,
        "data.max_tokens_per_pack": 512, "train.output_dir": f'"{out}"', "train.max_steps": 10,
        "train.eval_every": 0, "train.log_every": 1, "checkpoint.enable": "false",
        "checkpoint.export_hf": "false", "logging.tensorboard": "false", "scheduler.warmup_steps": 2,
    }
    if demo.startswith("demo_nemotron"):
        sets["moe.n_step_per_workload_report"] = 5
    run_job([f"{k}={v}" for k, v in sets.items()], config=REPO / "launch" / "configs" / f"{demo}.toml", timeout=600)
    rows = read_metrics(out / "metrics_train.csv")
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    if demo.startswith("demo_nemotron"):
        moe = [json.loads(r["extra"]) for r in rows if r.get("extra")]
        assert moe and all(k in moe[0] for k in ("moe/entropy_mean", "moe/max_fraction_max", "moe/tokens_per_layer_mean"))
        table = read_metrics(out / "moe_layer_expert_table.csv")
        assert table and {"step", "layer"} <= set(table[0])
