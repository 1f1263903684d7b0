"""`rl.rollout.weights = "expert_parallel"`: where it is accepted, where it is refused naming the key, and what
`--check` plans for the 30B-A3B recipes that use it.

Refused (exit 2, the message naming rl.rollout.weights and the other key): parallel.ep = 1 (no sharded experts to
mirror), megatron-core layers, tensor parallelism (not wired yet), [lora], asynchronous GRPO (allocation), the vLLM back end. `--check` on the two
published 30B-A3B GSPO recipes (16 ranks of 80 GiB, the layout their comments name) must plan the copy as the
dense parameters whole plus 1/ep of the routed experts in bf16, counted from the meta model's own modules here,
and fit.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.plan.check import run_check
from tests.fixtures.real_configs import write_real_model_folder

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
DEMO_GRPO = CONFIGS / "demo_grpo.toml"
EP = 'rl.rollout.weights="expert_parallel"'


def test_accepted_with_expert_parallelism():
    cfg = load_config(DEMO_GRPO, [EP, "parallel.ep=2"])
    assert cfg.rl.rollout.weights == "expert_parallel" and cfg.parallel.ep == 2


@pytest.mark.parametrize("sets, key", [
    ([], "parallel.ep"),
    (["parallel.ep=2", 'parallel.backend="mcore"'], "parallel.backend"),
    (["parallel.ep=2", "parallel.tp=2"], "parallel.tp"),
    (["parallel.ep=2", "lora.r=8", "train.train_layers=[]"], "lora"),
    (["parallel.ep=2", 'rl.allocation="rollout:1+train:1"'], "rl.allocation"),
    (["parallel.ep=2", 'rl.rollout_backend="vllm"'], "rl.rollout_backend"),
])
def test_refusals_name_the_key(sets, key):
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(DEMO_GRPO, [EP, *sets])
    msg = str(e.value)
    assert "rl.rollout.weights" in msg or "weights" in msg, msg
    assert key in msg or key.split(".")[-1] in msg, msg


def test_unknown_value_is_refused():
    with pytest.raises((ConfigError, ValueError), match="weights"):
        load_config(DEMO_GRPO, ['rl.rollout.weights="sharded"'])


def _gib(line: str, label: str) -> float:
    return float(re.search(rf"{label} ([0-9.]+) GiB", line).group(1))


@pytest.mark.parametrize("name, arch", [
    ("qwen3_vl_30b_a3b_geometry3k_gspo.toml", "qwen3_vl_30b_a3b"),
    ("nemotron_3_nano_vl_geometry3k_gspo.toml", "nemotron_3_nano_vl"),
])
def test_check_plans_the_expert_parallel_copy_of_the_30b_recipes(name, arch, tmp_path):
    from megatron_vlm.models import build_model

    folder = write_real_model_folder(arch, tmp_path / arch)
    cfg = load_config(CONFIGS / name, [f'model.path="{folder}"'])
    assert cfg.rl.rollout.weights == "expert_parallel" and cfg.parallel.ep > 1
    out, err = io.StringIO(), io.StringIO()
    assert run_check(cfg, world_size=16, device_memory_gib=80.0, out=out, err=err) == 0, out.getvalue() + err.getvalue()
    text = out.getvalue()
    copy_line = next(x for x in text.splitlines() if x.strip().startswith("rollout copy"))
    # expected from the model's modules: every parameter in bf16, the routed experts' divided by parallel.ep
    import json

    with torch.device("meta"):
        model = build_model(json.loads((folder / "config.json").read_text()))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in moe_layers(model) for p in m.experts.parameters())
    assert experts > 0.8 * total  # a 30B-A3B model is mostly routed experts
    want = (total - experts + experts / cfg.parallel.ep) * 2 / 2**30
    assert abs(_gib(copy_line, "rollout copy") - want) < 0.01, (copy_line, want)
    parts = next(x for x in text.splitlines() if x.strip().startswith("per rank:"))
    for label in ("policy", "gradients", "optimizer", "rollout copy", "KV pool", "routes"):
        assert re.search(rf"{label} [0-9.]+ GiB", parts), (label, parts)
    peak = float(re.search(r"peak ([0-9.]+) GiB of 80 GiB", text).group(1))
    assert peak < 80
    # the same recipe with its experts split over 8 ranks only (one node's ep) does not fit: the plan counts them
    cfg8 = load_config(CONFIGS / name, [f'model.path="{folder}"', "parallel.ep=8"])
    assert run_check(cfg8, world_size=16, device_memory_gib=80.0, out=io.StringIO(), err=io.StringIO()) == 2
