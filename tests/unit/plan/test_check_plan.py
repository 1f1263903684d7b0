"""The `--check` planner: the memory formulas on a small hand-computed case, the per-layer
activation and KV counts of toy modules, and `--check` on the example configs (meta device, no
weights; device memory 80 GiB): the shipped configs plan within it, and the GRPO config without a
rollout budget fails naming rl.rollout_memory_gib."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from torch import nn

from megatron_vlm.config import load_config
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.plan.check import run_check
from megatron_vlm.plan.memory import ModelShape, _layer_activation_elements, estimate_memory
from megatron_vlm.rl.rollout_budget import kv_elements_per_slot
from tests.unit.models.test_qwen2_5_vl_args import HUB_3B

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"


def test_memory_formulas_by_hand():
    shape = ModelShape(params=1000, trainable=600, largest_block=100, layers=4, hidden=8, act_per_token_layer=50,
                       kv_per_slot=16)
    m = estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10, activation_checkpointing=False,
                        rollout_prompts=3, group_size=2)
    assert m.params == 1000 * 4 / 2 == 2000
    assert m.grads == 600 * 4 / 2 == 1200
    assert m.optimizer == 600 * 2 * 4 / 2 == 2400
    assert m.gathered == 2 * 100 * 2 == 400
    assert m.activations_no_ckpt == 10 * 4 * 50 * 2 == 4000 == m.activations
    assert m.activations_ckpt == 10 * 4 * 8 * 2 + 10 * 50 * 2 == 1640
    assert m.kv_cache == 16 * 2 * 3 * 2 * 10 == 1920
    assert m.peak == 2000 + 1200 + 2400 + 400 + max(4000, 1920)
    ck = estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10, activation_checkpointing=True)
    assert ck.activations == 1640 and ck.kv_cache == 0 and ck.peak == 6000 + 1640


def test_layer_activation_and_kv_counts():
    layer = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    assert _layer_activation_elements(layer, hidden=8) == 2 * 8 + 2 * (12 + 8)
    model = nn.Module()
    model.language_model = nn.ModuleList([Attention(16, 4, 2, 4, qkv_bias=False), Attention(16, 4, 2, 4, qkv_bias=False)])
    model.vision = Attention(16, 4, 4, 4, qkv_bias=False)  # outside the decoder: no KV cache
    assert kv_elements_per_slot(model) == 2 * (2 * 2 * 4)


def _check(config: Path, overrides: list[str], world: int) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(config, overrides), world_size=world, device_memory_gib=80.0, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def qwen2_5_vl_3b(tmp_path_factory) -> Path:
    """A config-only Qwen2.5-VL-3B-Instruct folder (the published config.json, no weights)."""
    d = tmp_path_factory.mktemp("qwen2_5_vl_3b")
    (d / "config.json").write_text(json.dumps(HUB_3B))
    return d


# (config, ranks of its launch line)
REAL = [("qwen2_5_vl_3b_geometry3k_grpo.toml", 8), ("qwen2_5_vl_3b_virl39k_grpo.toml", 48)]
DEMOS = [("demo_sft.toml", 2), ("demo_grpo.toml", 2), ("demo_qwen3_vl.toml", 2), ("demo_internvl.toml", 2),
         ("demo_nemotron_vl.toml", 2), ("demo_nemotron_qwen3_vision.toml", 2)]


@pytest.mark.parametrize("name, world", REAL, ids=[r[0] for r in REAL])
def test_check_real_architecture_configs(name, world, qwen2_5_vl_3b):
    code, out, err = _check(CONFIGS / name, [f'model.path="{qwen2_5_vl_3b}"'], world)
    assert code == 0, err
    assert out.startswith("check ok: grpo run") and "3.755 B parameters" in out and "peak" in out


def test_check_grpo_without_rollout_budget_names_the_key(qwen2_5_vl_3b):
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml",
                            [f'model.path="{qwen2_5_vl_3b}"', "rl.rollout_memory_gib=0"], 8)
    assert code == 2 and err.startswith("check failed: rl.rollout_memory_gib: estimated peak") and len(err.splitlines()) == 1
    assert "66 per batch" in out  # all of a rank's 66 prompts at once


@pytest.mark.parametrize("name, world", DEMOS, ids=[d[0] for d in DEMOS])
def test_check_demo_configs(name, world, tmp_path):
    sets = [f'model.path="{tmp_path / "m"}"']
    if name == "demo_grpo.toml":  # starts from the demo SFT's export: the same tiny architecture
        sets.append('model.synthesize="tiny_qwen2_5_vl"')
    code, out, err = _check(CONFIGS / name, sets, world)
    assert code == 0, err
    assert "check ok" in out


def test_check_layout_error_names_the_key(qwen2_5_vl_3b):
    code, _, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml", [f'model.path="{qwen2_5_vl_3b}"', "parallel.dp_shard=3"], 8)
    assert code == 2 and err.startswith("check failed: parallel.dp_shard:")
