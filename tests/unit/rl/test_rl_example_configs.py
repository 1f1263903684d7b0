"""The GRPO example configs: their [rl] and [data] sections load strictly, carry the settings of the
published AReaL Geometry3K / ViRL39K runs (528 prompts per step, 16384 new tokens, clip 0.4, no KL), and their [data] column mapping reads
files in the dataset's schema."""
import pathlib

import pytest
import tomllib

from megatron_vlm.config.loader import from_dict
from megatron_vlm.data.config import DataConfig
from megatron_vlm.rl.config import RLConfig
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.rewards.config import MathRewardConfig
from tests.fixtures.rl_prompt_tables import write_geometry3k_fixture, write_virl39k_fixture

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "launch" / "configs"


@pytest.mark.parametrize(
    "name, group_size, schema, writer",
    [
        ("qwen2_5_vl_3b_geometry3k_grpo.toml", 4, "geometry3k", write_geometry3k_fixture),
        ("qwen2_5_vl_3b_virl39k_grpo.toml", 5, "virl39k", write_virl39k_fixture),
    ],
)
def test_example_config(name, group_size, schema, writer, tmp_path):
    raw = tomllib.loads((CONFIGS / name).read_text())
    assert raw["train"]["mode"] == "grpo"
    rl = from_dict(RLConfig, raw["rl"], "rl")
    assert (rl.batch.prompts_per_step, rl.rollout.max_new_tokens, rl.batch.group_size) == (528, 16384, group_size)
    assert (rl.loss.clip_ratio_low, rl.loss.clip_ratio_high, rl.loss.kl_coef) == (0.4, 0.4, 0.0)
    assert (rl.asynchronous.max_head_offpolicyness, rl.loss.behav_imp_weight_cap) == (4, 5.0)  # asynchronous, as the reference runs
    assert rl.allocation is not None
    rl.validate()
    assert rl.rewards == [MathRewardConfig()]
    data = from_dict(DataConfig, raw["data"], "data")
    assert data.type == "hf"
    path = writer(tmp_path, n=4)
    ds = load_prompt_dataset(path, columns=data.columns, prompt_template=rl.prompts.template)
    assert ds.schema == schema and len(ds) == 4 and ds.skipped == []
    assert "\\boxed{}" in ds[0].messages[-1]["content"][-1]["text"]


@pytest.mark.parametrize("name", ["qwen3_vl_30b_a3b_geometry3k_gspo.toml", "nemotron_3_nano_vl_geometry3k_gspo.toml"])
def test_moe_examples_use_gspo(name):
    raw = tomllib.loads((CONFIGS / name).read_text())
    rl = from_dict(RLConfig, raw["rl"], "rl")
    assert (rl.policy_loss, rl.loss.clip_ratio_low, rl.loss.clip_ratio_high, rl.loss.loss_agg) == ("gspo", 3e-4, 4e-4, "seq-mean")
    assert rl.batch.mini_batches_per_step > 1 and rl.recompute_logprobs  # off-policy updates: the ratio is not 1
    assert raw["parallel"]["ep"] > 1 and raw["moe"]["enable_moe_load_balancing_training"]
    assert raw["train"]["max_steps"] > 0  # GRPO runs a fixed number of steps


def test_dapo_example():
    raw = tomllib.loads((CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml").read_text())
    rl = from_dict(RLConfig, raw["rl"], "rl")
    assert (rl.loss.clip_ratio_low, rl.loss.clip_ratio_high, rl.loss.loss_agg, rl.loss.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert rl.advantages.dynamic_sampling and (rl.advantages.overlong_buffer, rl.advantages.overlong_penalty) == (4096, 1.0)
    assert (rl.batch.group_size, rl.batch.prompts_per_step, rl.batch.mini_batches_per_step) == (16, 512, 16)
    assert rl.loss.rollout_correction == "tis" and rl.recompute_logprobs
    assert raw["train"]["max_steps"] > 0
