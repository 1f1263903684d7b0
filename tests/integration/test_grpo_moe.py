"""GRPO of a MoE family (tiny Nemotron-VL: Mamba2, attention, MLP and MoE layers) on 2 processes:
the [moe] section works as in SFT — the auxiliary-free load balancing moves the score-correction
biases after each step (the exported biases differ from the initial ones, identically on both
ranks since the loads are summed over ranks), the moe/* metrics are logged and the per-layer
expert-load table is written."""
from __future__ import annotations

import pytest
import torch
from jobs import load_safetensors_dir, read_metrics, run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

pytestmark = pytest.mark.distributed


@pytest.mark.heavy  # ~15 s; CI keeps tests/unit/training/test_moe_balancing.py
def test_grpo_moe_load_balancing(tmp_path):
    out, assets = tmp_path / "run", tmp_path / "assets"
    sets = grpo_overrides(out, assets, **{
        "model.synthesize": '"tiny_nemotron_vl"', "train.max_steps": "2", "checkpoint.enable": "false",
        "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1", "rl.recompute_logprobs": "false", "rl.loss.kl_coef": "0.0",
        "moe.enable_moe_load_balancing_training": "true", "moe.bias_update_rate": "0.01",
        "moe.n_step_per_workload_report": "1", "train.log_every": "1", "train.train_layers": "[]",
    })
    run_job(sets, config=GRPO_DEMO, nproc=2, timeout=400)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    import json

    extra = [json.loads(r["extra"]) if r.get("extra") else {} for r in rows]
    for r, e in zip(rows, extra):
        for key in ("moe/entropy_mean", "moe/max_fraction_max", "moe/tokens_per_layer_mean"):
            assert key in r or key in e, (key, list(r), list(e))
    table = read_metrics(out / "moe_layer_expert_table.csv")
    assert table and {"step", "layer"} <= set(table[0])
    init, final = load_safetensors_dir(assets / "model"), load_safetensors_dir(out / "hf")
    bias_keys = [k for k in init if k.endswith("e_score_correction_bias")]
    assert bias_keys
    moved = [k for k in bias_keys if not torch.equal(init[k].float(), final[k].float())]
    assert moved, "the load-balancing biases did not move"
    for k in moved:
        b = final[k].float()
        assert abs(float(b.mean())) < 1e-6  # the update is centred: zero-mean biases
