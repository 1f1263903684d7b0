"""The GRPO generation-budget check names the key to change, and a GRPO resume with another prompt
order is refused naming its key (the whole-job versions: tests/integration/test_grpo_config_refusals.py)."""
from types import SimpleNamespace

import pytest

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.data_state import grpo_data_state, grpo_data_state_refusal
from megatron_vlm.rl.prompts.lengths import check_generation_budget, prompt_token_budget


def _cfgs(pack: int, rollout: int, eval_tokens=None):
    return (SimpleNamespace(max_tokens_per_pack=pack),
            SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=rollout), eval=SimpleNamespace(max_new_tokens=eval_tokens)))


def test_budget_names_the_generation_key_or_the_pack_size():
    assert prompt_token_budget(*_cfgs(160, 6, 3)) == 154
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.max_new_tokens: 200 generated tokens leave no room for a "
                                          r"prompt in data\.max_tokens_per_pack = 160 tokens"):
        prompt_token_budget(*_cfgs(160, 200))
    with pytest.raises(ConfigError, match=r"^rl\.eval\.max_new_tokens: 160 generated tokens"):
        check_generation_budget(*_cfgs(160, 6, 160))
    with pytest.raises(ConfigError, match=r"^data\.max_tokens_per_pack: 512 leaves no room for a prompt before "
                                          r"rl\.rollout\.max_new_tokens = 1024 generated tokens"):
        check_generation_budget(*_cfgs(512, 1024))


def test_data_state_refusal_names_the_key():
    now = {"seed": 0, "num_prompts": 32, "prompts_per_step": 4}
    state = grpo_data_state(3, **now)
    assert grpo_data_state_refusal(state, **now) is None
    assert grpo_data_state_refusal({"next_step": 3, "seed": 0, "num_prompts": 32}, **now) is None  # older checkpoint
    msg = grpo_data_state_refusal(state, **{**now, "seed": 1})
    assert msg is not None and msg.startswith("train.seed: the checkpoint was written with train.seed = 0, this run has "
                                              "train.seed = 1; the prompt order would differ. Set train.seed = 0")
    msg = grpo_data_state_refusal(state, **{**now, "num_prompts": 30})
    assert msg is not None and msg.startswith("data.train_path: the checkpoint was written drawing from 32 train prompts")


def test_a_packed_data_position_is_refused_as_another_job_kinds():
    """A checkpoint whose layout record predates train.mode (loaded as before) may be an SFT / DPO run's: its data
    state is a pack position, not a prompt order, and used to pass the check whenever train.seed agreed."""
    now = {"seed": 0, "num_prompts": 32, "prompts_per_step": 4}
    sft = {"global_packs_consumed": 6, "packs_consumed_on_rank": 6, "dp_size": 1, "epoch": 0, "seed": 0,
           "num_records": 32, "capacity": 512}
    msg = grpo_data_state_refusal(sft, **now)
    assert msg is not None and msg.startswith("train.mode: the checkpoint's data state is a packed-data position") \
        and "\n" not in msg, msg
    assert 'checkpoint.resume = "none"' in msg
