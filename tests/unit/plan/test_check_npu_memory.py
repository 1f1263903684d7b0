"""`--check` without --device-memory-gib reads the device memory of an NPU machine as of a CUDA one: a fake
`torch.npu` (torch_npu's documented is_available / get_device_properties(i).total_memory) stands in."""
from __future__ import annotations

import io
import json
import types

import torch

from megatron_vlm.config import load_config_dict
from megatron_vlm.plan.check import run_check
from tests.unit.models.test_qwen2_5_vl_args import HUB_3B


def _eval_cfg(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HUB_3B))  # config only: the plan runs on the meta device
    return load_config_dict({"model": {"path": str(tmp_path)}, "train": {"mode": "eval"},
                             "eval": {"batch_size": 1, "samples": 1,
                                      "benchmarks": [{"name": "g", "path": "/d", "format": "geometry3k"}]}})


def test_check_reads_npu_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = types.SimpleNamespace(is_available=lambda: True,
                                 get_device_properties=lambda i: types.SimpleNamespace(total_memory=64 * 2**30))
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    out, err = io.StringIO(), io.StringIO()
    assert run_check(_eval_cfg(tmp_path), world_size=1, device_memory_gib=None, out=out, err=err) == 0, err.getvalue()
    assert "of 64 GiB" in out.getvalue(), out.getvalue()


def test_check_without_accelerator_asks_for_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delattr(torch, "npu", raising=False)
    out, err = io.StringIO(), io.StringIO()
    assert run_check(_eval_cfg(tmp_path), world_size=1, device_memory_gib=None, out=out, err=err) == 2
    assert "--device-memory-gib: no accelerator visible" in err.getvalue()
