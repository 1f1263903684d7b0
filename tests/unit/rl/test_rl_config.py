"""`[rl]` section: defaults validate, cross-field checks name the offending field, reward tables
are built per `type`, and the prompt template renders."""
import pytest

from megatron_vlm.rl.config import RLConfig, RLEvalConfig
from megatron_vlm.rl.rewards.config import (
    CustomRewardConfig,
    FormatRewardConfig,
    MathRewardConfig,
    reward_from_dict,
)


def test_defaults_validate_and_render_prompt():
    cfg = RLConfig()
    cfg.validate()
    assert cfg.render_prompt("Find x.").startswith("Find x.")
    assert "\\boxed{}" in cfg.render_prompt("Find x.")
    assert cfg.accuracy_label() == "math"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(group_size=1), "group_size"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(clip_ratio_low=1.0), "clip_ratio_low"),
        (dict(clip_ratio_high=-0.1), "clip_ratio_high"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(ref_offload=True, kl_coef=0.0), "ref_offload"),
        (dict(prompts_per_step=1, group_size=2, mini_batches_per_step=3), "mini_batches_per_step"),
        (dict(rewards=[]), "rewards"),
        (dict(rewards=[MathRewardConfig(), MathRewardConfig()]), "rewards"),
        (dict(rewards=[MathRewardConfig(rel_tol=2.0)]), "rewards[0].rel_tol"),
        (dict(accuracy_reward="nope"), "accuracy_reward"),
        (dict(reward_timeout_s=0.0), "reward_timeout_s"),
        (dict(rollout_batch_prompts=-1), "rollout_batch_prompts"),
        (dict(rollout_weights="both"), "rollout_weights"),
        (dict(rollout_cuda_graphs="yes"), "rollout_cuda_graphs"),
        (dict(rollout_cuda_graphs="on"), "rollout_cuda_graphs"),  # rollout_weights = "shared": lock-step FSDP forwards
        (dict(prompt_template="no placeholder"), "prompt_template"),
        (dict(prompt_template="{problem} {other}"), "prompt_template"),
        (dict(stop=[""]), "stop"),
        (dict(behav_imp_weight_cap=0.5), "behav_imp_weight_cap"),
        # asynchronous-only knobs are refused while only the synchronous trainer exists
        (dict(behav_imp_weight_cap=5.0), "behav_imp_weight_cap"),
        (dict(max_head_offpolicyness=4), "max_head_offpolicyness"),
        (dict(eval=RLEvalConfig(k=4, temperature=0.0)), "eval.temperature"),
        # algorithm keys
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(advantage="reinforce"), "advantage"),
        (dict(loss_agg="sum"), "loss_agg"),
        (dict(advantage="dr_grpo", normalize_adv_std=True), "normalize_adv_std"),
        (dict(advantage="rloo", normalize_adv_std=True), "normalize_adv_std"),
        (dict(dynamic_sampling=True, max_sampling_rounds=0), "max_sampling_rounds"),
        (dict(overlong_buffer=-1), "overlong_buffer"),
        (dict(overlong_buffer=1024, overlong_penalty=1.0), "overlong_buffer"),
        (dict(overlong_buffer=64), "overlong_penalty"),
        (dict(overlong_penalty=1.0), "overlong_penalty"),
        (dict(overlong_buffer=64, overlong_penalty=-1.0), "overlong_penalty"),
        (dict(entropy_coef=-0.01), "entropy_coef"),
        (dict(rollout_correction="tis"), "rollout_correction"),  # needs recompute_logprobs
        (dict(rollout_correction="mis"), "rollout_correction"),
        (dict(rollout_correction="is", recompute_logprobs=True), "rollout_correction"),
        (dict(rollout_correction="tis", recompute_logprobs=True, rollout_correction_cap=1.0), "rollout_correction_cap"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        RLConfig(**kwargs).validate()
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_named_rewards_may_repeat_a_type():
    cfg = RLConfig(
        rewards=[MathRewardConfig(), MathRewardConfig(name="math_lenient", rel_tol=1e-2), FormatRewardConfig(weight=0.1)],
        accuracy_reward="math",
    )
    cfg.validate()
    assert [r.label() for r in cfg.rewards] == ["math", "math_lenient", "format"]


def test_reward_from_dict_is_strict():
    r = reward_from_dict({"type": "format", "weight": 0.5, "require_boxed": True})
    assert isinstance(r, FormatRewardConfig) and r.require_boxed and r.weight == 0.5
    with pytest.raises(ValueError, match=r"rl.rewards\[0\].requre_boxed: unknown key"):
        reward_from_dict({"type": "format", "requre_boxed": True})
    with pytest.raises(ValueError, match=r"rl.rewards\[2\].type"):
        reward_from_dict({"type": "maths"}, where="rl.rewards[2]")
    with pytest.raises(ValueError, match=r"\.function: expected a dotted path"):
        reward_from_dict({"type": "custom", "function": "__import__('os')"})
    with pytest.raises(ValueError, match=r"\.kwargs"):
        reward_from_dict({"type": "custom", "function": "a.b", "kwargs": {"prompt": 1}})
    c = reward_from_dict({"type": "custom", "function": "my_pkg.rewards.fn", "kwargs": {"alpha": 2}})
    assert isinstance(c, CustomRewardConfig) and c.kwargs == {"alpha": 2}


def test_algorithm_keys_load_strictly():
    from megatron_vlm.config.loader import ConfigError, from_dict

    rl = from_dict(RLConfig, {"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg": "seq-mean",
                              "advantage": "dr_grpo", "dynamic_sampling": True, "max_sampling_rounds": 4,
                              "overlong_buffer": 256, "overlong_penalty": 1.0, "mask_truncated": True, "entropy_coef": 0.001,
                              "recompute_logprobs": True, "rollout_correction": "mis", "rollout_correction_cap": 2.0}, "rl")
    assert rl.policy_loss == "gspo" and rl.adv_normalize_std() is False
    with pytest.raises(ConfigError, match=r"^rl\.rollout_correction: .*recompute_logprobs"):
        from_dict(RLConfig, {"rollout_correction": "tis"}, "rl")
    with pytest.raises(ConfigError, match=r"^rl\.policy_loss"):
        from_dict(RLConfig, {"policy_loss": "GSPO"}, "rl")
