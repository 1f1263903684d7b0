"""A `parallel.backend = "mcore"` run with parallel.tp = 2 (2 processes, tiny Qwen2.5-VL): its distributed
checkpoint (megatron-core names, fc1 rows laid out per tp rank) converts offline with
`launch/convert_checkpoint.py` to the run's own Hugging Face export, tensor for tensor; a LoRA run's to its PEFT
adapter and (--merge) its merged export."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from jobs import REPO, load_safetensors_dir, run_job, small_demo_overrides

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # ~20 s each


def test_mcore_tp2_checkpoint_converts_to_the_runs_export(tmp_path):
    run_job(small_demo_overrides(tmp_path / "warmup", tmp_path, **{"train.max_steps": 1, "checkpoint.enable": "false",
                                                                     "checkpoint.export_hf": "false"}))
    out = tmp_path / "run"
    run_job(small_demo_overrides(out, tmp_path, **{"parallel.backend": '"mcore"', "parallel.tp": 2,
                                                   "train.max_steps": 2, "checkpoint.every_steps": 2,
                                                   "train.eval_generate": "false", "data.synthetic_eval_size": 4}),
            nproc=2)
    conv = tmp_path / "converted"
    subprocess.run([sys.executable, str(REPO / "launch/convert_checkpoint.py"), "--checkpoint",
                    str(out / "checkpoints" / "step_2"), "--out", str(conv)], check=True, cwd=str(REPO), timeout=300)
    a, b = load_safetensors_dir(out / "hf"), load_safetensors_dir(conv)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mcore_tp2_lora_checkpoint_converts_to_the_runs_adapter_and_merged_export(tmp_path):
    from test_lora_job import _overrides

    run_job(small_demo_overrides(tmp_path / "warmup", tmp_path, **{"train.max_steps": 1, "checkpoint.enable": "false",
                                                                     "checkpoint.export_hf": "false"}))
    out = tmp_path / "run"
    run_job(_overrides(out, tmp_path, **{"parallel.backend": '"mcore"', "parallel.tp": 2}), nproc=2)
    for merge, theirs in ((False, "adapter"), (True, "hf")):
        conv = tmp_path / f"converted_{theirs}"
        subprocess.run([sys.executable, str(REPO / "launch/convert_checkpoint.py"), "--checkpoint",
                        str(out / "checkpoints" / "step_3"), "--out", str(conv), *(["--merge"] if merge else [])],
                       check=True, cwd=str(REPO), timeout=300)
        a, b = load_safetensors_dir(out / theirs), load_safetensors_dir(conv)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), theirs
