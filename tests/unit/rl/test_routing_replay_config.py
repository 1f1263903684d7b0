"""`rl.routing_replay`: where "rollout" is accepted, where it is refused naming the key, and what `--check` reports.

Refused (exit 2, the message naming rl.routing_replay): the vLLM back end (it returns no routes here) and
pipeline parallelism (a stage runs a slice of the MoE layers). Context parallelism (a context-parallel layer takes
its chunks' routes) and megatron-core MoE layers (their router's top-k hook) are accepted.
`--check` on the published 30B-A3B configs prints the routes' bytes per token: MoE layers x top-k x 1 byte (int8 ids of 128 experts), from the configs' own numbers.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.plan.check import run_check
from tests.fixtures.real_configs import write_real_model_folder

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
DEMO_GRPO = CONFIGS / "demo_grpo.toml"


def test_rollout_is_accepted_on_the_builtin_engine():
    assert load_config(DEMO_GRPO, ['rl.routing_replay="rollout"']).rl.routing_replay == "rollout"
    assert load_config(DEMO_GRPO, ['rl.routing_replay="rollout"', "parallel.ep=2", "parallel.tp=2"]).parallel.ep == 2
    assert load_config(DEMO_GRPO, ['rl.routing_replay="rollout"', "parallel.cp=2"]).parallel.cp == 2
    assert load_config(DEMO_GRPO, ['rl.routing_replay="rollout"', 'parallel.backend="mcore"']).parallel.backend == "mcore"


@pytest.mark.parametrize("sets, why", [
    (['rl.rollout_backend="vllm"'], "vllm back end does not return"),
    (["parallel.pp=2"], "parallel.pp = 2"),
])
def test_refusals_name_the_key(sets, why):
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(DEMO_GRPO, ['rl.routing_replay="rollout"', *sets])
    assert "routing_replay" in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.parametrize("name, arch, per_token, layers", [
    ("qwen3_vl_30b_a3b_geometry3k_gspo.toml", "qwen3_vl_30b_a3b", 48 * 8, 48),  # 48 MoE layers, top 8 of 128
    ("nemotron_3_nano_vl_geometry3k_gspo.toml", "nemotron_3_nano_vl", 23 * 6, 23),  # 23 MoE layers, top 6 of 128
])
def test_check_reports_the_recorded_routes(name, arch, per_token, layers, tmp_path):
    folder = write_real_model_folder(arch, tmp_path / arch)
    cfg = load_config(CONFIGS / name, [f'model.path="{folder}"'])
    assert cfg.rl.routing_replay == "rollout"  # the 30B recipes replay
    out, err = io.StringIO(), io.StringIO()
    assert run_check(cfg, world_size=16, device_memory_gib=80.0, out=out, err=err) == 0, out.getvalue() + err.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.startswith("routes"))
    assert f"{layers} MoE layers" in line and f"= {per_token} B per token (int8), replayed" in line, line


def test_a_policy_without_moe_layers_is_refused(tmp_path):
    """Replay forces recorded MoE routes: on a dense policy it would replay nothing, so "rollout" there is a key
    accepted and not acted on (before: a warning in the run's log, --check passed)."""
    folder = write_real_model_folder("qwen3_vl_2b", tmp_path / "dense")
    cfg = load_config(CONFIGS / "qwen3_vl_2b_geometry3k_grpo.toml", [f'model.path="{folder}"', 'rl.routing_replay="rollout"'])
    out, err = io.StringIO(), io.StringIO()
    assert run_check(cfg, world_size=8, device_memory_gib=80.0, out=out, err=err) == 2
    assert err.getvalue().startswith("check failed: rl.routing_replay: 'rollout'") and "no MoE layers" in err.getvalue()
