"""`[rl]` section: defaults validate, cross-field checks name the offending field, reward tables
are built per `type`, and the prompt template renders."""
import pytest

from megatron_vlm.rl.config import MOVED_KEYS, RLConfig, RLEvalConfig
from megatron_vlm.rl.rewards.config import (
    CustomRewardConfig,
    FormatRewardConfig,
    MathRewardConfig,
    reward_from_dict,
)
from tests.fixtures.rl_config import rl_config


def test_defaults_validate_and_render_prompt():
    cfg = RLConfig()
    cfg.validate()
    assert cfg.render_prompt("Find x.").startswith("Find x.")
    assert "\\boxed{}" in cfg.render_prompt("Find x.")
    assert cfg.accuracy_label() == "math"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(group_size=1), "batch.group_size"),
        (dict(temperature=0.0), "rollout.temperature"),
        (dict(top_p=0.0), "rollout.top_p"),
        (dict(top_k=-1), "rollout.top_k"),
        (dict(clip_ratio_low=1.0), "loss.clip_ratio_low"),
        (dict(clip_ratio_high=-0.1), "loss.clip_ratio_high"),
        (dict(kl_coef=-1.0), "loss.kl_coef"),
        (dict(ref_offload=True, kl_coef=0.0), "update.ref_offload"),
        (dict(kl_estimator="k1", kl_coef=0.0), "loss.kl_estimator"),  # no reference: no KL of either estimator
        (dict(kl_estimator="k1", kl_coef=0.0, advantage="gae"), "loss.kl_estimator"),  # nor a KL in PPO's reward
        (dict(prompts_per_step=1, group_size=2, mini_batches_per_step=3), "batch.mini_batches_per_step"),
        (dict(rewards=[]), "rewards"),
        (dict(rewards=[MathRewardConfig(), MathRewardConfig()]), "rewards"),
        (dict(rewards=[MathRewardConfig(rel_tol=2.0)]), "rewards[0].rel_tol"),
        (dict(accuracy_reward="nope"), "accuracy_reward"),
        (dict(reward_timeout_s=0.0), "reward_pool.timeout_s"),
        (dict(reward_workers=0), "reward_pool.workers"),
        (dict(rollout_batch_prompts=-1), "rollout.batch_prompts"),
        (dict(rollout_weights="both"), "rollout.weights"),
        (dict(rollout_cuda_graphs="yes"), "rollout.cuda_graphs"),
        (dict(rollout_cuda_graphs="on"), "rollout.cuda_graphs"),  # rollout.weights = "shared": lock-step FSDP forwards
        (dict(prompt_template="no placeholder"), "prompts.template"),
        (dict(prompt_template="{problem} {other}"), "prompts.template"),
        (dict(prompt_template="{problem} {problem.upper}"), "prompts.template"),  # renders "<built-in method ...>"
        (dict(prompt_template="{problem} {problem.__class__}"), "prompts.template"),
        (dict(stop=[""]), "rollout.stop"),
        (dict(behav_imp_weight_cap=0.5), "loss.behav_imp_weight_cap"),
        # asynchronous-only knobs are refused without the asynchronous loop
        (dict(behav_imp_weight_cap=5.0), "loss.behav_imp_weight_cap"),
        (dict(max_head_offpolicyness=4), "asynchronous.max_head_offpolicyness"),
        (dict(eval=RLEvalConfig(k=4, temperature=0.0)), "eval.temperature"),
        (dict(eval=RLEvalConfig(top_p=0.9)), "eval.top_p"),  # greedy (temperature 0) decoding reads no top_p
        # memory_gib sizes the rollout batch only when batch_prompts is 0: set both, the budget did nothing
        (dict(rollout_memory_gib=24.0, rollout_batch_prompts=4), "rollout.memory_gib"),
        # algorithm keys
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(advantage="reinforce"), "advantage"),
        (dict(loss_agg="sum"), "loss.loss_agg"),
        (dict(advantage="dr_grpo", normalize_adv_std=True), "advantages.normalize_std"),
        (dict(advantage="rloo", normalize_adv_std=True), "advantages.normalize_std"),
        (dict(dynamic_sampling=True, max_sampling_rounds=0), "advantages.max_sampling_rounds"),
        (dict(max_sampling_rounds=5), "advantages.max_sampling_rounds"),  # one round without dynamic sampling
        (dict(rollout_correction_cap=3.0), "loss.rollout_correction_cap"),  # rollout_correction = "none": no cap read
        (dict(overlong_buffer=-1), "advantages.overlong_buffer"),
        (dict(overlong_buffer=1024, overlong_penalty=1.0), "advantages.overlong_buffer"),
        (dict(overlong_buffer=64), "advantages.overlong_penalty"),
        (dict(overlong_penalty=1.0), "advantages.overlong_penalty"),
        (dict(overlong_buffer=64, overlong_penalty=-1.0), "advantages.overlong_penalty"),
        (dict(entropy_coef=-0.01), "loss.entropy_coef"),
        (dict(rollout_correction="tis"), "loss.rollout_correction"),  # needs recompute_logprobs
        (dict(rollout_correction="mis"), "loss.rollout_correction"),
        (dict(rollout_correction="is", recompute_logprobs=True), "loss.rollout_correction"),
        (dict(rollout_correction="tis", recompute_logprobs=True, rollout_correction_cap=1.0), "loss.rollout_correction_cap"),
        # selection keys of later backends
        (dict(rollout_backend="sglang"), "rollout_backend"),
        (dict(rollout_backend="vllm", rollout__weights="copy"), "rollout.weights"),  # a key of the built-in engine only
        (dict(allocation="vllm:d1+d1"), "allocation"),  # vLLM's rollout ranks with the built-in back end
        (dict(routing_replay="yes"), "routing_replay"),
        (dict(routing_replay="rollout", rollout_backend="vllm"), "routing_replay"),  # vLLM returns no routes here
        # vLLM's log-probs are of the truncated distribution: old log-probs from the training forward only
        (dict(rollout_backend="vllm", rollout__top_p=0.9), "rollout.top_p"),
        (dict(rollout_backend="vllm", rollout__top_k=20), "rollout.top_k"),
        # ... and the loss terms that divide by the rollout's log-probs (TIS / MIS, the decoupled loss's pi_behav)
        # would read vLLM's truncated ones where the built-in engine's are of the whole distribution
        (dict(rollout_backend="vllm", rollout__top_p=0.9, recompute_logprobs=True, rollout_correction="tis"),
         "rollout.top_p"),
        (dict(rollout_backend="vllm", rollout__top_k=20, recompute_logprobs=True, rollout_correction="mis"),
         "rollout.top_k"),
        (dict(rollout_backend="vllm", rollout__top_p=0.9, recompute_logprobs=True, allocation="vllm:d1+d1",
              max_head_offpolicyness=1), "rollout.top_p"),
        (dict(rollout_backend="vllm", rollout__top_p=0.9, allocation="vllm:d1+d1", max_head_offpolicyness=1),
         "rollout.top_p"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        rl_config(validate=True, **kwargs)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_vllm_truncated_sampling_under_a_behaviour_weight_is_refused_without_asking_for_recompute():
    """The refusal names what would not help: recompute_logprobs leaves TIS / MIS / the decoupled loss dividing by
    vLLM's truncated log-probs, so the message does not send the user there first."""
    with pytest.raises(ValueError, match="decoupled loss") as e:
        rl_config(validate=True, rollout_backend="vllm", rollout__top_p=0.9, allocation="vllm:d1+d1",
                  max_head_offpolicyness=1)
    assert "recompute_logprobs" not in str(e.value)


def test_vllm_truncated_sampling_needs_the_training_side_old_logprobs():
    rl_config(validate=True, rollout_backend="vllm", rollout__top_p=0.9, rollout__top_k=20, recompute_logprobs=True)
    rl_config(validate=True, rollout__top_p=0.9, rollout__top_k=20)  # the built-in engine reports the whole distribution
    # the rollout's log-probs in no loss term: the asynchronous loop at offpolicyness 0 (the synchronous loss)
    rl_config(validate=True, rollout_backend="vllm", rollout__top_p=0.9, recompute_logprobs=True, allocation="vllm:d1+d1")
    # the built-in engine with the same loss terms: its log-probs are of the whole distribution, as the trainer's
    rl_config(validate=True, rollout__top_p=0.9, recompute_logprobs=True, rollout_correction="tis")
    rl_config(validate=True, rollout__top_k=20, allocation="rollout:1+train:1", max_head_offpolicyness=1)


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

    rl = from_dict(RLConfig, {"policy_loss": "gspo", "advantage": "dr_grpo", "recompute_logprobs": True,
                              "loss": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg": "seq-mean",
                                       "entropy_coef": 0.001, "rollout_correction": "mis", "rollout_correction_cap": 2.0},
                              "advantages": {"dynamic_sampling": True, "max_sampling_rounds": 4, "overlong_buffer": 256,
                                             "overlong_penalty": 1.0},
                              "update": {"mask_truncated": True}}, "rl")
    assert rl.policy_loss == "gspo" and rl.adv_normalize_std() is False and rl.loss.loss_agg == "seq-mean"
    with pytest.raises(ConfigError, match=r"^rl\.loss\.rollout_correction: .*recompute_logprobs"):
        from_dict(RLConfig, {"loss": {"rollout_correction": "tis"}}, "rl")
    with pytest.raises(ConfigError, match=r"^rl\.policy_loss"):
        from_dict(RLConfig, {"policy_loss": "GSPO"}, "rl")
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.top_k: must be >= 0"):
        from_dict(RLConfig, {"rollout": {"top_k": -1}}, "rl")


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_key_of_the_flat_layout_is_refused_naming_its_new_place(old):
    """No silent aliasing: `[rl] group_size = 8` fails with the key it moved to."""
    from megatron_vlm.config.loader import ConfigError, from_dict

    new = MOVED_KEYS[old]
    with pytest.raises(ConfigError, match=rf"^rl\.{old}: moved to rl\.{new} "):
        from_dict(RLConfig, {old: 1}, "rl")


def test_an_old_config_exits_2_naming_the_new_key(tmp_path):
    """The entry point: a config with a flat key exits 2 and its one-line message names the new key."""
    from pathlib import Path

    from tests.unit.launch_in_process import run_launcher

    repo = Path(__file__).resolve().parents[3]
    demo = (repo / "launch" / "configs" / "demo_grpo.toml").read_text()
    old = tmp_path / "old.toml"
    old.write_text(demo.replace("[rl]\n", "[rl]\ngroup_size = 8\n", 1))
    r = run_launcher("pretrain_vlm", ["--config", old, "--check"], cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rl.group_size: moved to rl.batch.group_size" in r.stderr + r.stdout
    r = run_launcher("pretrain_vlm", ["--config", repo / "launch" / "configs" / "demo_grpo.toml", "--check", "--set",
                                      "rl.kl_coef=0.1"], cwd=tmp_path)
    assert r.returncode == 2 and "rl.kl_coef: moved to rl.loss.kl_coef" in r.stderr + r.stdout
