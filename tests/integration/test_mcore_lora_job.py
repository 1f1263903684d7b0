"""A LoRA SFT job through the entry point with `parallel.backend = "mcore"` (tiny Qwen2.5-VL, adapter dropout and
activation checkpointing on, 1 process): its losses, grad norms, PEFT adapter and merged export equal the native
backend's run of the same config, and its checkpoint resumes to the same adapter. Parallel layouts (tp included):
tests/integration/parallel/test_mcore_lora_parallel.py."""
from __future__ import annotations

import json

import pytest
import torch
from jobs import load_safetensors_dir, read_metrics, run_job
from test_lora_job import _overrides

pytest.importorskip("megatron.core")


def _metrics(out):
    return {int(x["step"]): (float(x["loss"]), float(x["grad_norm"])) for x in read_metrics(out / "metrics_train.csv")}


def _assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys() and a
    worst = max(((a[k] - b[k]).abs().max().item(), k) for k in a)
    assert worst[0] <= atol, worst


@pytest.mark.heavy  # ~21 s; CI keeps the unit tests (tests/unit/mcore/test_mcore_lora.py)
def test_mcore_lora_job_equals_native(tmp_path):
    native, mcore, resumed = tmp_path / "native", tmp_path / "mcore", tmp_path / "resumed"
    run_job(_overrides(native, tmp_path))
    r = run_job(_overrides(mcore, tmp_path, **{"parallel.backend": '"mcore"'}))
    assert "megatron-core layers" in r.stderr
    m_n, m_m = _metrics(native), _metrics(mcore)
    assert sorted(m_n) == sorted(m_m) == [1, 2, 3] and len({v[0] for v in m_n.values()}) > 1
    for step in m_n:
        for x, y in zip(m_n[step], m_m[step]):
            assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (step, m_n[step], m_m[step])

    a_n, a_m = load_safetensors_dir(native / "adapter"), load_safetensors_dir(mcore / "adapter")
    assert len(a_n) == 2 * 4 * 2 and max(v.abs().max().item() for k, v in a_n.items() if "lora_B" in k) > 0
    _assert_close(a_n, a_m, 1e-5)
    c_n = json.loads((native / "adapter" / "adapter_config.json").read_text())
    c_m = json.loads((mcore / "adapter" / "adapter_config.json").read_text())
    assert c_n == c_m
    _assert_close(load_safetensors_dir(native / "hf"), load_safetensors_dir(mcore / "hf"), 1e-5)

    # the mcore run's checkpoint (adapter factors and their optimizer state) resumes to the same adapter
    r = run_job(_overrides(resumed, tmp_path, **{"parallel.backend": '"mcore"',
                                                 "checkpoint.resume": f'"{mcore / "checkpoints" / "step_2"}"'}))
    assert "Resumed from checkpoint: step=2" in r.stderr
    a_r = load_safetensors_dir(resumed / "adapter")
    assert a_r.keys() == a_m.keys() and all(torch.equal(a_r[k], a_m[k]) for k in a_m)
    assert _metrics(resumed)[3] == m_m[3]
