"""Expert parallelism through the entry point: the tiny Nemotron-VL demo (8 routed experts per MoE
layer) on 2 processes with parallel.ep=2 (also with activation checkpointing) trains exactly like
parallel.ep=1 (experts sharded by FSDP instead): the same loss and grad-norm trajectory (fp32, 1e-5)
and the same Hugging Face export (full expert tensors gathered from the ep shards), also when
converted offline from the ep=2 distributed checkpoint; a run resumed from its ep=2 checkpoint
continues with the same losses."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from jobs import REPO, load_safetensors_dir, read_metrics, run_job

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DEMO = REPO / "launch" / "configs" / "demo_nemotron_vl.toml"


def _sets(tmp_path, out, **extra) -> list[str]:
    sets = {
        "model.path": f'"{tmp_path / "model"}"', "data.synthetic_dir": f'"{tmp_path / "data"}"',
        "data.synthetic_train_size": 32, "data.synthetic_eval_size": 0, "data.num_workers": 0,
        "data.max_tokens_per_pack": 256, "train.output_dir": f'"{out}"', "train.max_steps": 4,
        "train.eval_every": 0, "train.log_every": 1, "checkpoint.every_steps": 2,
        "logging.tensorboard": "false", "scheduler.warmup_steps": 1, "moe.n_step_per_workload_report": 2,
    }
    sets.update(extra)
    return [f"{k}={v}" for k, v in sets.items()]


def _column(out, key):
    return [float(r[key]) for r in read_metrics(out / "metrics_train.csv")]


@pytest.mark.heavy
def test_ep2_matches_ep1(tmp_path):
    ep1, ep2 = tmp_path / "ep1", tmp_path / "ep2"
    run_job(_sets(tmp_path, ep1, **{"parallel.ep": 1}), nproc=2, config=DEMO, timeout=600)
    # ep=2 also with activation checkpointing: the recomputed forward repeats the all-to-alls.
    run_job(_sets(tmp_path, ep2, **{"parallel.ep": 2, "train.activation_checkpointing": "true"}), nproc=2,
            config=DEMO, timeout=600)
    l1, l2 = _column(ep1, "loss"), _column(ep2, "loss")
    assert len(l1) == len(l2) == 4
    assert max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-5, (l1, l2)
    g1, g2 = _column(ep1, "grad_norm"), _column(ep2, "grad_norm")
    assert max(abs(a - b) for a, b in zip(g1, g2)) <= 1e-5 * max(g1), (g1, g2)

    p1, p2 = load_safetensors_dir(ep1 / "hf"), load_safetensors_dir(ep2 / "hf")
    assert p1.keys() == p2.keys()
    experts = [k for k in p1 if ".experts." in k]
    assert experts and all(p1[k].shape == p2[k].shape for k in p1)
    worst = max(((p1[k] - p2[k]).abs().max().item(), k) for k in p1)
    assert worst[0] <= 1e-5, worst
    # Offline conversion of the ep=2 distributed checkpoint gives the export's tensors.
    conv = tmp_path / "converted"
    subprocess.run([sys.executable, str(REPO / "launch/convert_checkpoint.py"), "--checkpoint",
                    str(ep2 / "checkpoints" / "step_4"), "--out", str(conv)], check=True, cwd=str(REPO), timeout=300)
    p3 = load_safetensors_dir(conv)
    assert p3.keys() == p2.keys() and all(torch.equal(p3[k], p2[k]) for k in p2)

    # Resume the ep=2 run from its step-2 distributed checkpoint: steps 3-4 repeat exactly.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ep2 / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    run_job(_sets(tmp_path, resumed, **{"parallel.ep": 2, "train.activation_checkpointing": "true",
                                        "checkpoint.export_hf": "false"}), nproc=2, config=DEMO, timeout=600)
    l3 = _column(resumed, "loss")
    assert len(l3) == 2 and max(abs(a - b) for a, b in zip(l3, l2[2:])) <= 1e-6, (l3, l2)
