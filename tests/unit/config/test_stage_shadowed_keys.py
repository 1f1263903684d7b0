"""A main-section key that every `[[stages]]` table sets for itself is never read (each stage's config takes the
stage's value): it was accepted without a word, so `--set train.max_steps=10` (a smoke test of a curriculum) or
`--set optimizer.lr=1e-3` changed nothing and the stages ran their own lengths and learning rates. Refused, naming
the key; a stage that leaves the key out still takes the main value."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config, load_config_dict
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.config.stage_configs import stage_configs

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"
CURRICULUM = CONFIGS / "internvl3_8b_robovqa_curriculum.toml"


@pytest.mark.parametrize("item, key", [
    ("train.max_steps=10", "train.max_steps"),
    ("train.epochs=2", "train.epochs"),
    ("optimizer.lr=1e-3", "optimizer.lr"),
    ("data.max_frames=2", "data.max_frames"),
    ("data.max_tokens_per_pack=1024", "data.max_tokens_per_pack"),
    ('data.train_path="other.jsonl"', "data.train_path"),
    ('data.eval_path="other.jsonl"', "data.eval_path"),
])
def test_a_main_key_every_stage_sets_is_refused(item, key):
    cfg = load_config(CURRICULUM, [item])
    with pytest.raises(ConfigError, match=rf"^{key}: every \[\[stages\]\] table sets its own"):
        check_keys_for_mode(cfg)


@pytest.mark.parametrize("name", ["internvl3_8b_robovqa_curriculum.toml", "demo_internvl_video.toml"])
def test_the_shipped_stage_configs_set_no_main_key_their_stages_replace(name):
    check_keys_for_mode(load_config(CONFIGS / name))


def test_a_stage_that_leaves_the_key_out_takes_the_main_value():
    raw = {"model": {"path": "m"}, "data": {"type": "messages_jsonl", "max_frames": 6},
           "train": {"mode": "sft", "max_steps": 7, "train_layers": ["^language_model\\."]},
           "optimizer": {"lr": 3e-4},
           "stages": [{"name": "a", "train_path": "a.jsonl", "lr": 1e-4, "max_frames": 2, "epochs": 1.0},
                      {"name": "b", "train_path": "b.jsonl"}]}
    cfg = load_config_dict(raw)
    check_keys_for_mode(cfg)
    a, b = stage_configs(cfg)
    assert (a.optimizer.lr, a.data.max_frames, a.train.epochs, a.train.max_steps) == (1e-4, 2, 1.0, None)
    assert (b.optimizer.lr, b.data.max_frames, b.train.epochs, b.train.max_steps) == (3e-4, 6, None, 7)
    assert a.train.train_layers == b.train.train_layers == ["^language_model\\."]
