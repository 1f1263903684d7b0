"""`[train] mode = "reward"` and the `[reward]` keys work in the mode that reads them or exit 2 naming the key: the
section in another mode, `[dpo]` in reward mode, what the mode does not run yet (tp / cp / pp / ep > 1, the mcore
backend, [lora], fp8), the keys of other modes it ignores, the preference columns, and a model folder that is
already a reward model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.training.reward.build import reward_folder_refusal
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]
RM = REPO / "launch" / "configs" / "demo_reward_model.toml"
SFT = REPO / "launch" / "configs" / "demo_sft.toml"


def _check(config, *overrides):
    check_keys_for_mode(load_config(config, list(overrides)))


@pytest.mark.parametrize("overrides", [
    (), ("reward.margin=0.5", "reward.center_rewards_coefficient=0.01", "reward.head_init_std=0.1"),
    ("train.micro_batches_per_step=2", "train.eval_max_batches=2", "parallel.dp_shard=-1"),
    ('data.type="hf"', 'data.train_path="x.parquet"', 'data.columns={prompt = "p", chosen = "c", rejected = "r"}',
     "train.eval_every=0"),
])
def test_reward_mode_accepts_its_keys(overrides):
    _check(RM, *overrides)


@pytest.mark.parametrize("overrides, key", [
    (("reward.center_rewards_coefficient=-1",), "reward.center_rewards_coefficient"),
    (("reward.head_init_std=-0.1",), "reward.head_init_std"),
    (("reward.beta=0.1",), "reward.beta"),                                       # unknown key
    (("dpo.beta=0.1",), "dpo"),
    (("train.eval_generate=false",), "train.eval_generate"),
    (("parallel.cp=2",), "parallel.cp"),
    (("parallel.tp=2",), "parallel.tp"),
    (("parallel.ep=2",), "parallel.ep"),
    (('parallel.backend="mcore"',), "parallel.backend"),
    (("lora.r=4", "train.train_layers=[]"), "lora"),
    (('train.precision="fp8"',), "train.precision"),
    (("rl.group_size=4",), "rl"),
    (('data.type="hf"', 'data.train_path="x.parquet"', 'data.columns={prompt = "p", chosen = "c"}'), "data.columns"),
])
def test_reward_mode_refuses_keys_it_ignores_or_cannot_run(overrides, key):
    with pytest.raises(ConfigError) as e:
        _check(RM, *overrides)
    assert str(e.value).startswith(key), str(e.value)


def test_reward_section_in_another_mode_is_refused():
    with pytest.raises(ConfigError, match=r"^reward: the \[reward\] section is only read when train.mode = \"reward\""):
        _check(SFT, "reward.margin=0.2")


def test_a_sequence_classification_folder_is_refused_as_the_start():
    assert reward_folder_refusal({"architectures": ["Qwen2ForCausalLM"]}, "m") is None
    why = reward_folder_refusal({"architectures": ["Qwen2_5_VLForSequenceClassification"]}, "m")
    assert why is not None and why.startswith("model.path: m is already a sequence-classification folder")


def test_entry_point_exits_2_naming_the_key(tmp_path):
    r = run_launcher("pretrain_vlm", ["--config", RM, "--check", "--device-memory-gib", "8"])
    assert r.returncode == 0 and "check ok: reward run" in r.stdout and "reward     Bradley-Terry" in r.stdout, r.stderr
    r = run_launcher("pretrain_vlm", ["--config", RM, "--check", "--device-memory-gib", "8", "--set", "parallel.tp=2"])
    assert r.returncode == 2 and "parallel.tp: 2 with train.mode = \"reward\"" in r.stderr, r.stderr[-2000:]
    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForSequenceClassification"],
                                                    "model_type": "qwen2_5_vl"}))
    r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(RM), "--set",
                        f'model.path="{folder}"', "--set", f'train.output_dir="{tmp_path / "run"}"', "--set",
                        f'data.synthetic_dir="{tmp_path / "data"}"', "--set", "data.synthetic_train_size=8", "--set",
                        "data.synthetic_eval_size=4"], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert r.returncode == 2 and "model.path:" in r.stderr and "sequence-classification" in r.stderr, r.stderr[-2000:]


def _score_folder(tmp_path) -> Path:
    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForSequenceClassification"],
                                                    "model_type": "qwen2_5_vl", "num_labels": 1}))
    return folder


@pytest.mark.parametrize("config", [RM, REPO / "launch" / "configs" / "demo_dpo.toml", SFT])
def test_check_refuses_a_sequence_classification_folder_as_the_model(tmp_path, config):
    """--check said ok for a reward model folder as `model.path` (the reward job refuses it at start; the other
    modes stopped on a traceback at the weights: `score.weight` has no place in a causal model)."""
    from megatron_vlm.plan.check import CheckFailed, plan_run

    folder = _score_folder(tmp_path)
    cfg = load_config(config, [f'model.path="{folder}"', "model.synthesize=\"tiny_qwen2_5_vl\""])
    with pytest.raises(CheckFailed) as e:
        plan_run(cfg, world_size=1, device_memory_gib=80)
    assert e.value.key == "model.path" and "sequence-classification" in str(e.value), str(e.value)


def test_a_sequence_classification_folder_is_refused_as_a_dpo_policy(tmp_path):
    """The DPO / SFT / GRPO job itself: a config error naming model.path (exit 2), before the folder is read."""
    from types import SimpleNamespace

    from megatron_vlm.training.model_bundle import build_model_bundle

    folder = _score_folder(tmp_path)
    cfg = load_config(REPO / "launch" / "configs" / "demo_dpo.toml", [f'model.path="{folder}"'])
    with pytest.raises(ConfigError, match=r"^model\.path: .* is a sequence-classification folder"):
        build_model_bundle(SimpleNamespace(cfg=cfg, env=None))
