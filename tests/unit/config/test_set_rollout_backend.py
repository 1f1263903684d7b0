"""`--set rl.rollout_backend=...` on a recipe written for the other engine drops the file's keys only that engine
reads, as the other switches of `apply_overrides` do: `builtin` on a vLLM recipe its `[rl.vllm]` table, `vllm` on a
built-in recipe the engine's own `[rl.rollout]` keys (weights, memory_gib, ...). Both were refused ("the [rl.vllm]
table is only read with rollout_backend = 'vllm'"), so trying a recipe on the other engine meant editing it. Such keys
also given with `--set` stay refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.loader import _SWITCH_OFF_DROPS
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.rl.config import RLConfig, RLRolloutConfig, VLLMConfig

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"


@pytest.mark.parametrize("name", ["qwen2_5_math_1_5b_grpo_vllm.toml", "qwen2_5_vl_3b_geometry3k_grpo_vllm.toml"])
def test_builtin_on_a_vllm_recipe_drops_its_vllm_table(name):
    assert load_config(CONFIGS / name).rl.vllm != VLLMConfig()
    cfg = load_config(CONFIGS / name, ["rl.rollout_backend=builtin"])
    assert cfg.rl.rollout_backend == "builtin" and cfg.rl.vllm == VLLMConfig()
    check_keys_for_mode(cfg)


@pytest.mark.parametrize("name, key", [("qwen2_5_math_1_5b_grpo.toml", "weights"),
                                       ("qwen2_5_vl_3b_geometry3k_grpo.toml", "memory_gib")])
def test_vllm_on_a_builtin_recipe_drops_the_engines_own_keys(name, key):
    assert getattr(load_config(CONFIGS / name).rl.rollout, key) != getattr(RLRolloutConfig(), key)
    cfg = load_config(CONFIGS / name, ['rl.rollout_backend="vllm"'])
    assert cfg.rl.rollout_backend == "vllm" and getattr(cfg.rl.rollout, key) == getattr(RLRolloutConfig(), key)
    assert cfg.rl.rollout.max_new_tokens == load_config(CONFIGS / name).rl.rollout.max_new_tokens  # shared keys kept


@pytest.mark.parametrize("name, sets, match", [
    ("qwen2_5_math_1_5b_grpo_vllm.toml", ["rl.rollout_backend=builtin", "rl.vllm.max_num_seqs=8"], r"^rl\.vllm: "),
    ("qwen2_5_math_1_5b_grpo.toml", ["rl.rollout_backend=vllm", 'rl.rollout.weights="copy"'], r"^rl\.rollout\.weights: "),
    # the key before the switch, or both in one inline table: the table's drop took the --set key with it
    ("qwen2_5_math_1_5b_grpo_vllm.toml", ["rl.vllm.max_num_seqs=8", "rl.rollout_backend=builtin"], r"^rl\.vllm: "),
    ("qwen2_5_math_1_5b_grpo_vllm.toml", ['rl={vllm={max_num_seqs=8}, rollout_backend="builtin"}'], r"^rl\.vllm: "),
])
def test_idle_keys_given_with_set_stay_refused(name, sets, match):
    with pytest.raises(ConfigError, match=match):
        check_keys_for_mode(load_config(CONFIGS / name, sets))


def test_the_dropped_rollout_keys_are_the_builtin_engine_keys():
    dropped = _SWITCH_OFF_DROPS[("rl", "rollout_backend")]["vllm"]
    assert sorted(dropped) == sorted(f"rollout.{k}" for k in RLConfig._BUILTIN_ENGINE_KEYS)
