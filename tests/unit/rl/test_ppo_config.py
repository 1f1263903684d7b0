"""PPO's config: `[rl.critic]` and `advantages.gamma` / `lam` are read only with advantage = "gae" (refused
otherwise, naming the key), what the critic does not run with is refused (exit 2 through the entry point), and
a critic folder that cannot read the policy's prompts is refused before it is loaded."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vlm.rl.critic.build import critic_folder_refusal, critic_refusal
from tests.fixtures.rl_config import rl_config

REPO = Path(__file__).resolve().parents[3]
PPO_DEMO = REPO / "launch" / "configs" / "demo_ppo.toml"


def test_gae_with_a_critic_validates():
    cfg = rl_config(advantage="gae", critic__lr=3e-4, critic__warmup_steps=2, advantages__gamma=0.99,
                    advantages__lam=0.9, kl_coef=0.05, validate=True)
    assert cfg.critic.model == "policy" and cfg.advantages.gamma == 0.99
    rl_config(advantage="gae", policy_loss="cispo", validate=True)
    rl_config(advantage="gae", policy_loss="gspo_token", validate=True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(critic__lr=1e-4), "critic"),  # [rl.critic] without advantage = "gae"
    (dict(advantage="rloo", critic__warmup_steps=3), "critic"),
    (dict(advantages__gamma=0.9), "advantages.gamma"),
    (dict(advantages__lam=0.9), "advantages.lam"),
    (dict(advantage="gae", advantages__gamma=1.5), "advantages.gamma"),
    (dict(advantage="gae", advantages__lam=-0.1), "advantages.lam"),
    (dict(advantage="gae", critic__lr=0.0), "critic.lr"),
    (dict(advantage="gae", critic__value_clip=-1.0), "critic.value_clip"),
    (dict(advantage="gae", critic__warmup_steps=-1), "critic.warmup_steps"),
    (dict(advantage="gae", critic__value_loss="huber"), "critic.value_loss"),
    (dict(advantage="gae", critic__model=""), "critic.model"),
    (dict(advantage="gae", policy_loss="gspo"), "policy_loss"),  # one advantage per sequence
    (dict(advantage="gae", allocation="rollout:1+train:1"), "advantage"),  # asynchronous GRPO: not yet
])
def test_refusals_name_the_key(kwargs, field):
    with pytest.raises(ValueError) as e:
        rl_config(validate=True, **kwargs)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_vllm_backend_is_accepted():
    """The critic lives on the training ranks: the rollout back end does not matter."""
    rl_config(advantage="gae", rollout_backend="vllm", validate=True)


class _Cfg:
    def __init__(self, **parallel):
        self.parallel = type("P", (), {"tp": 1, "cp": 1, "pp": 1, "ep": 1, "backend": "native", **parallel})()
        self.rl = rl_config(advantage="gae")


@pytest.mark.parametrize("parallel, key", [({"tp": 2}, "parallel.tp"), ({"cp": 2}, "parallel.cp"), ({"pp": 2}, "parallel.pp"),
                                           ({"ep": 2}, "parallel.ep"), ({"backend": "mcore"}, "parallel.backend")])
def test_layouts_the_critic_does_not_run_with_are_refused(parallel, key):
    msg = critic_refusal(_Cfg(**parallel))
    assert msg is not None and msg.startswith(key + ":"), msg
    assert critic_refusal(_Cfg()) is None


def test_a_critic_folder_must_read_the_policys_prompts():
    policy = {"model_type": "qwen2_5_vl", "vocab_size": 1000, "image_token_id": 7, "vision_config": {"patch_size": 14}}
    assert critic_folder_refusal(policy, dict(policy), "small") is None
    for change, key in (({"vocab_size": 999}, "vocab_size"), ({"model_type": "qwen3_vl"}, "model_type"),
                        ({"image_token_id": 8}, "image_token_id"), ({"vision_config": {"patch_size": 16}}, "patch_size")):
        msg = critic_folder_refusal(policy, {**policy, **change}, "small")
        assert msg is not None and msg.startswith("rl.critic.model: small") and key in msg, msg


def test_an_internvl_chat_critic_folder_must_read_the_policys_prompts():
    """OpenGVLab's `internvl_chat` layout keeps the language model's settings in `llm_config` and the image token in
    `img_context_token_id` (151667 when absent), and InternVL sizes its image tokens by `downsample_ratio` and
    `vision_config.image_size`: a critic folder differing there was taken (only model_type matched), and its first
    forward on the policy's packs met token ids past its vocabulary or image placeholders its vision path does not
    fill, after the step's rollout. Refused at start, naming the key; the same settings spelled out or left at their
    default are the same."""
    policy = {"model_type": "internvl_chat", "llm_config": {"model_type": "qwen2", "vocab_size": 151674},
              "vision_config": {"patch_size": 14, "image_size": 448}, "downsample_ratio": 0.5}
    assert critic_folder_refusal(policy, dict(policy), "small") is None
    assert critic_folder_refusal(policy, {**policy, "img_context_token_id": 151667}, "small") is None
    for change, key in (({"llm_config": {"model_type": "qwen2", "vocab_size": 151936}}, "vocab_size"),
                        ({"img_context_token_id": 151668}, "image_token_id"),
                        ({"downsample_ratio": 0.25}, "downsample_ratio"),
                        ({"vision_config": {"patch_size": 14, "image_size": 224}}, "image_size")):
        msg = critic_folder_refusal(policy, {**policy, **change}, "small")
        assert msg is not None and msg.startswith("rl.critic.model: small") and key in msg, (change, msg)
    hf = {"model_type": "internvl", "text_config": {"vocab_size": 1024}, "image_token_id": 970, "downsample_ratio": 0.5,
          "vision_config": {"patch_size": [14, 14], "image_size": [56, 56]}}
    assert critic_folder_refusal(hf, dict(hf), "small") is None
    msg = critic_folder_refusal(hf, {**hf, "vision_config": {"patch_size": [14, 14], "image_size": [112, 112]}}, "small")
    assert msg is not None and "image_size" in msg, msg


@pytest.mark.parametrize("sets, key", [("parallel.tp=2", "parallel.tp"), ("parallel.cp=2", "parallel.cp"),
                                       ("parallel.ep=2", "parallel.ep"), ('parallel.backend="mcore"', "parallel.backend")])
def test_the_config_loader_refuses_those_layouts(sets, key):
    """At load time (exit 2 from the entry point and --check alike), as reward-model training's layouts are: found
    only when the critic was built, such a run first loaded and sharded the policy on every rank."""
    from megatron_vlm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"^{key}: .*PPO's critic"):
        load_config(PPO_DEMO, [sets])


def _check(tmp_path, *sets: str) -> subprocess.CompletedProcess:
    sets = (f'model.path="{tmp_path / "m"}"', 'model.synthesize="tiny_qwen2_5_vl"', *sets)
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(PPO_DEMO), "--check",
                           "--device-memory-gib", "80", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)


@pytest.mark.heavy  # two entry-point processes (~25 s of CPU)
def test_entry_point_exits_2_naming_the_key(tmp_path):
    """(demo_ppo.toml itself passes --check: tests/unit/plan/test_check_plan.py.)"""
    r = _check(tmp_path, 'rl.advantage="grpo"')  # [rl.critic] left in a GRPO config
    assert r.returncode == 2 and "rl.critic: the [rl.critic] table is only read with advantage = 'gae'" in r.stderr + r.stdout
    r = _check(tmp_path, 'rl.allocation="rollout:1+train:1"')
    assert r.returncode == 2 and "rl.advantage: 'gae' (PPO with a critic) is not supported with allocation" in r.stderr + r.stdout


def test_a_reward_model_folder_as_the_critic_is_refused_naming_the_key():
    """A `...ForSequenceClassification` folder (e.g. a reward model of `train.mode = "reward"`) has a `score` head
    and no lm_head: the critic's loader would stop on its tensors with a traceback. Refused (exit 2) instead."""
    policy = {"model_type": "qwen2_5_vl", "vocab_size": 1000, "image_token_id": 7, "vision_config": {"patch_size": 14},
              "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    rm = {**policy, "architectures": ["Qwen2_5_VLForSequenceClassification"], "num_labels": 1}
    msg = critic_folder_refusal(policy, rm, "rm")
    assert msg is not None and msg.startswith("rl.critic.model: rm") and "ForSequenceClassification" in msg, msg


def test_a_warmup_as_long_as_the_run_is_refused_naming_the_key():
    """`critic.warmup_steps` >= the run's steps: the policy would never be updated, the run would export the policy
    it started from without a word. Refused by the config checks (train.max_steps, so --check finds it) and by the
    job once the length is known (train.epochs)."""
    from megatron_vlm.config import load_config
    from megatron_vlm.config.loader import ConfigError
    from megatron_vlm.config.mode_keys import check_keys_for_mode

    rl = rl_config(advantage="gae", critic__warmup_steps=5, validate=True)
    assert rl.critic_warmup_refusal(6) is None and rl.critic_warmup_refusal(None) is None
    for steps in (5, 3):
        msg = rl.critic_warmup_refusal(steps)
        assert msg is not None and msg.startswith("rl.critic.warmup_steps:") and f"{steps} steps" in msg, msg
    assert rl_config(advantage="grpo").critic_warmup_refusal(1) is None
    cfg = load_config(PPO_DEMO, overrides=["train.max_steps=5"])
    with pytest.raises(ConfigError, match=r"^rl\.critic\.warmup_steps: 5 "):
        check_keys_for_mode(cfg)
    check_keys_for_mode(load_config(PPO_DEMO, overrides=["train.max_steps=6"]))
