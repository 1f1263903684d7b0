"""`--set stages[0].max_steps=10` on a stage that gives its length as `epochs` (the curriculum recipe's stages do)
replaces the file's `epochs`, as `--set train.max_steps=...` replaces the file's `train.epochs`: both are the one
length, and the command line is what the user means. It was refused as "set max_steps or epochs, not both", so a
smoke test of a curriculum had to copy and edit the recipe. Both given with `--set` stay refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.config.stage_configs import stage_configs

CURRICULUM = Path(__file__).resolve().parents[3] / "launch" / "configs" / "internvl3_8b_robovqa_curriculum.toml"


def test_a_stage_length_on_the_command_line_replaces_the_files_other_one():
    cfg = load_config(CURRICULUM, ["stages[0].max_steps=10", "stages.1.max_steps=5"])
    assert [(s.max_steps, s.epochs) for s in cfg.stages] == [(10, None), (5, None)]
    check_keys_for_mode(cfg)
    assert [(s.train.max_steps, s.train.epochs) for s in stage_configs(cfg)] == [(10, None), (5, None)]


def test_both_stage_lengths_on_the_command_line_stay_refused():
    with pytest.raises(ConfigError, match=r"^stages\[1\]\.epochs: set max_steps or epochs, not both"):
        load_config(CURRICULUM, ["stages[1].max_steps=5", "stages[1].epochs=0.5"])
