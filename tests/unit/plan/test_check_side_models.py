"""`--check` counts the models a GRPO / PPO run holds beside the policy (plan/side_models.py): PPO's critic (its
weights, gradients and AdamW states, unsharded on every rank) and the reward models / judges (a compute-dtype copy
per rank, or on the device only while scoring with `offload`), checked against parameter counts written out by
hand from Qwen2.5-Math-1.5B's published shapes; a run that fits without them and not with them exits 2 naming the
key; the job's critic refusals are found by --check too."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.plan.check import _meta_model, _read_folder_config, _read_model_config, run_check
from megatron_vlm.plan.side_models import side_models_plan
from tests.fixtures.real_configs import real_config, write_real_model_folder

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"
GiB = 2**30

# Qwen2.5-Math-1.5B by hand: vocab 151936, hidden 1536, 28 layers, MLP 8960, 12 heads / 2 KV heads of 128, q/k/v
# biases, tied embedding (so the lm_head is the embedding: no extra parameters)
V, H, L, FF, KV = 151936, 1536, 28, 8960, 2 * 128
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * FF + 2 * H
P_MATH = V * H + L * LAYER + H


def _side(config: Path, overrides: list[str]):
    cfg = load_config(config, overrides)
    hf = _read_model_config(cfg)  # a model.synthesize tiny model without its folder too
    return side_models_plan(cfg, hf, build=_meta_model, read=_read_folder_config, tokens=cfg.data.max_tokens_per_pack,
                            master_bytes=4, compute_bytes=2)


def test_critic_weights_gradients_and_optimizer_by_hand(tmp_path):
    folder = write_real_model_folder("qwen2_5_math_1_5b", tmp_path / "math")
    side = _side(CONFIGS / "qwen2_5_math_1_5b_grpo.toml", [f'model.path="{folder}"', 'rl.advantage="gae"'])
    params = trainable = P_MATH + H + 1  # + the value head (weight and bias); everything trains (tied lm_head)
    assert side.resident == params * 4 + trainable * 4 + trainable * 8
    assert side.transient > 0 and "critic     a copy of the policy: 1.544 B parameters" in side.lines[0]
    frozen = _side(CONFIGS / "qwen2_5_math_1_5b_grpo.toml",
                   [f'model.path="{folder}"', 'rl.advantage="gae"', 'train.train_layers=["^language_model\\\\.layers\\\\."]'])
    trainable = L * LAYER + H + 1  # the decoder layers and the head
    assert frozen.resident == params * 4 + trainable * 4 + trainable * 8


def _reward_folder(tmp_path, kind: str) -> Path:
    cfg = real_config("qwen2_5_math_1_5b")
    if kind == "model":
        cfg.update(architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    folder = tmp_path / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _grpo_with(tmp_path, table: str) -> list[str]:
    return [f'model.path="{tmp_path / "policy"}"', 'model.synthesize="tiny_qwen2_5_vl"',
            f'rl.rewards=[{table}, {{type = "exact_match", weight = 0.0}}]']


def test_reward_model_and_judge_copies_by_hand(tmp_path):
    rm, judge = _reward_folder(tmp_path, "model"), _reward_folder(tmp_path, "judge")
    side = _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{rm}"}}'))
    assert side.resident == (P_MATH + H) * 2 and side.transient == 0  # no lm_head (tied: the embedding stays) + score
    off = _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{rm}", offload = true}}'))
    assert off.resident == 0 and off.transient == (P_MATH + H) * 2
    side = _side(CONFIGS / "demo_grpo.toml",
                 _grpo_with(tmp_path, f'{{type = "judge", path = "{judge}", batch_size = 4, max_tokens = 512}}'))
    assert side.resident == P_MATH * 2 + 2 * L * KV * 2 * 4 * 512  # the whole LM + the KV cache of its slots
    missing = _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{tmp_path / "none"}"}}'))
    assert missing.resident == 0 and "no config.json yet, not counted" in missing.lines[0]


def test_a_reward_model_shorter_than_the_pack_says_it_truncates(tmp_path):
    """The reward model re-tokenizes the conversation, so `max_tokens` cannot be checked exactly against the policy's
    bound (`data.max_tokens_per_pack`, 1024 in the demo); --check says what happens past it."""
    rm = _reward_folder(tmp_path, "model")
    short = _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{rm}", max_tokens = 512}}'))
    assert any("rl.rewards[0].max_tokens = 512 < data.max_tokens_per_pack = 1024" in x and "truncated" in x
               for x in short.lines), short.lines
    enough = _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{rm}"}}'))
    assert not any("truncated" in x for x in enough.lines)


def _check(config: Path, overrides: list[str], gib: float, world: int = 1) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(config, overrides), world_size=world, device_memory_gib=gib, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_run_that_fits_only_without_its_reward_model_names_the_key(tmp_path):
    rm = _reward_folder(tmp_path, "model")
    code, out, err = _check(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, '{type = "format"}'), 2.0)
    assert code == 0, err
    code, out, err = _check(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "model", path = "{rm}"}}'), 2.0)
    assert code == 2 and err.startswith("check failed: rl.rewards[0].offload: estimated peak"), err
    assert "reward     rl.rewards[0] (model)" in out and "held through the run" in out


def test_critic_refusals_and_size_are_found_by_check(tmp_path):
    sets = [f'model.path="{tmp_path / "policy"}"', 'model.synthesize="tiny_qwen2_5_vl"']
    code, out, err = _check(CONFIGS / "demo_ppo.toml", sets, 8.0)
    assert code == 0 and "critic     a copy of the policy" in out, err
    math = write_real_model_folder("qwen2_5_math_1_5b", tmp_path / "math")
    code, _, err = _check(CONFIGS / "demo_ppo.toml", [*sets, f'rl.critic.model="{math}"'], 8.0)
    assert code == 2 and err.startswith("check failed: rl.critic.model:") and "model_type" in err, err
    code, _, err = _check(CONFIGS / "demo_ppo.toml", [*sets, f'rl.critic.model="{tmp_path / "nothing"}"'], 8.0)
    assert code == 2 and err.startswith("check failed: rl.critic.model:") and "config.json" in err, err


def test_critic_memory_makes_a_tight_device_fail_naming_the_critic(tmp_path):
    """The PPO run of a 1.5B policy on a device that holds its GRPO run: the critic's weights, gradients and AdamW
    states (16 bytes per parameter in fp32) are added to the peak, and a device between the two fails on them."""
    math = write_real_model_folder("qwen2_5_math_1_5b", tmp_path / "math")
    # a small rollout budget: the critic, not the KV cache, is then the largest part of the peak
    config, sets = CONFIGS / "qwen2_5_math_1_5b_grpo.toml", [f'model.path="{math}"', "rl.rollout.memory_gib=4"]
    code, out, err = _check(config, sets, 80.0, 2)  # its launch line's 2 ranks
    assert code == 0, err
    peak = float(out.split("  peak ")[1].split(" GiB")[0])
    need = (P_MATH + H + 1) * 16 / GiB
    code, out, err = _check(config, [*sets, 'rl.advantage="gae"'], 80.0, 2)
    assert code == 0, err
    with_critic = float(out.split("  peak ")[1].split(" GiB")[0])
    assert with_critic >= peak + need - 0.01
    code, _, err = _check(config, [*sets, 'rl.advantage="gae"'], peak + need / 2, 2)
    assert code == 2 and err.startswith("check failed: rl.critic.model: estimated peak"), err



def test_a_reward_model_folder_without_a_scalar_head_is_refused_by_check(tmp_path):
    """The run refuses a `type = "model"` folder whose architectures name no ...ForSequenceClassification model (a
    policy-like ...ForCausalLM folder); --check passed it (it only counted its size) and now names the key too."""
    from types import SimpleNamespace as NS

    import pytest

    from megatron_vlm.plan.side_models import SideModelRefused
    from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig, ModelRewardConfig

    causal = _reward_folder(tmp_path, "judge")  # a Qwen2ForCausalLM config.json
    cfg = NS(train=NS(mode="grpo"), rl=NS(advantage="grpo", rewards=[ExactMatchRewardConfig(),
                                                                      ModelRewardConfig(path=str(causal))]))
    with pytest.raises(SideModelRefused, match=r"ForSequenceClassification") as e:
        side_models_plan(cfg, {}, build=_meta_model, read=_read_folder_config, tokens=64, master_bytes=4, compute_bytes=2)
    assert e.value.key == "rl.rewards[1].path"


def test_max_tokens_past_the_folders_positions_is_refused_by_check(tmp_path):
    """--check refuses what the run refuses at start: a reward model's or judge's `max_tokens` above the folder's
    `max_position_embeddings` (4096 for Qwen2.5-Math-1.5B), naming the key."""
    import pytest

    from megatron_vlm.plan.side_models import SideModelRefused

    for kind in ("model", "judge"):
        folder = _reward_folder(tmp_path, kind)
        with pytest.raises(SideModelRefused, match=r"8192 is above .*max_position_embeddings = 4096") as e:
            _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "{kind}", path = "{folder}", max_tokens = 8192}}'))
        assert e.value.key == "rl.rewards[0].max_tokens"
        _side(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, f'{{type = "{kind}", path = "{folder}", max_tokens = 4096}}'))


def test_a_judge_template_holding_a_special_token_fails_the_check(tmp_path):
    """The run refuses a judge whose template's own text holds one of its tokenizer's special strings (every judge
    prompt would be refused: each judgement an error scoring 0); --check passed it and now exits 2 naming the key."""
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    judge = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "judge")

    def check(template: str) -> tuple[int, str]:
        table = f'{{type = "judge", path = "{judge}", max_tokens = 512, template = "{template}"}}'
        out, err = io.StringIO(), io.StringIO()
        code = run_check(load_config(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, table)), world_size=1,
                         device_memory_gib=80.0, out=out, err=err)
        return code, err.getvalue()

    code, err = check("Is {completion} right?<|im_end|> Yes or no?")
    assert code == 2 and err.startswith("check failed: rl.rewards[0].template: ") and "<|im_end|>" in err
    assert check("Is {completion} right? Yes or no?") == (0, "")
    # a special token that is no placeholder or turn / end token is text a prompt may hold: the run accepts it
    assert check("Is {completion} right? <|vision_pad|> Yes or no?") == (0, "")


def test_a_nemotron_judge_template_holding_its_video_placeholder_fails_the_check(tmp_path):
    """Nemotron-VL's video placeholder "<video>" is no added token (its tokenizer does not name it: the processor's
    default), so the tokenizer files alone missed it: --check passed a judge template the run refuses at start."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.rl.rewards.config import JudgeRewardConfig
    from megatron_vlm.rl.rewards.judge import JudgeRewardScorer
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    judge = synthesize_model_folder("tiny_nemotron_vl", tmp_path / "judge")
    template = "Watch the <video>: is {completion} right? Yes or no?"
    with pytest.raises(ConfigError, match=r"^rl\.rewards\.template: .*'<video>'"):
        JudgeRewardScorer(JudgeRewardConfig(path=str(judge), template=template, max_tokens=512))  # the run
    table = f'{{type = "judge", path = "{judge}", max_tokens = 512, template = "{template}"}}'
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(CONFIGS / "demo_grpo.toml", _grpo_with(tmp_path, table)), world_size=1,
                     device_memory_gib=80.0, out=out, err=err)
    assert code == 2 and err.getvalue().startswith("check failed: rl.rewards[0].template: ") and "'<video>'" in err.getvalue()
