"""Generation-based evaluation with the tp / cp ranks of a data-parallel group decoding the same rows.

`[train] mode = "eval"` with parallel.tp = 2 hung (rank 1 took its global rank as its data-parallel rank, was
told "dp_rank must be in [0, 1)", skipped the benchmark, and rank 0 waited in the sharded decoder's
collectives), and with cp = 2 aborted in gloo for the same reason. And the SFT held-out answer accuracy counted
every row once per tp / cp rank (answer_n doubled). Reference: the same jobs on one process, whose rows and
greedy answers the 2-rank jobs must give exactly (tiny random Qwen2.5-VL, fp32, greedy)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import REPO, read_metrics, run_job, small_demo_overrides

from tests.fixtures.eval_config import write_eval_config

pytestmark = pytest.mark.distributed


def _eval_config(tmp_path, model, data) -> Path:
    return write_eval_config(
        tmp_path / "eval.toml", model, tmp_path / "unused",
        [{"name": "vqa", "path": data / "eval.jsonl", "image_root": data, "format": "messages"}],
        data={"max_tokens_per_pack": 256}, train={"mode": "eval"}, eval={"max_new_tokens": 4, "batch_size": 3})


def _rows(out):
    res = json.loads((out / "eval_results.json").read_text())["benchmarks"]["vqa"]
    preds = [json.loads(line) for line in (out / "eval_predictions" / "vqa.jsonl").open()]
    return res["metrics"]["num_scored"], [(p["index"], p["greedy"]) for p in preds]


@pytest.mark.parametrize("dim", ["tp", pytest.param("cp", marks=pytest.mark.heavy)])
def test_eval_job_with_tp_or_cp_scores_each_row_once_as_one_process(tmp_path, dim):
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    model = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "model")
    data = tmp_path / "data"
    write_synthetic_vqa(data, n_train=4, n_eval=7)
    cfg = _eval_config(tmp_path, model, data)
    one, two = tmp_path / "one", tmp_path / dim
    run_job([f'train.output_dir="{one}"'], config=cfg, timeout=300)
    run_job([f'train.output_dir="{two}"', f"parallel.{dim}=2"], nproc=2, config=cfg, timeout=300)
    n1, rows1 = _rows(one)
    n2, rows2 = _rows(two)
    assert n1 == n2 == 7 and len(rows1) == 7
    assert rows2 == rows1


@pytest.mark.heavy
def test_sft_answer_accuracy_with_tp_counts_each_row_once(tmp_path):
    assets = tmp_path / "assets"
    out = tmp_path / "tp2"
    run_job(small_demo_overrides(out, assets, **{"parallel.tp": "2", "train.max_steps": "2", "train.eval_every": "2",
                                                 "checkpoint.every_steps": "0", "checkpoint.export_hf": "false"}),
            nproc=2, config=REPO / "launch" / "configs" / "demo_sft.toml", timeout=300)
    ev = read_metrics(out / "metrics_eval.csv")
    assert float(ev[-1]["answer_n"]) == 8  # data.synthetic_eval_size = 8 rows, each scored once
