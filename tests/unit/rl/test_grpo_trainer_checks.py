"""GRPO set-up checks that need no model: a missing start checkpoint names the command that makes
it (the demo's short SFT run), and the demo config's hint is that command."""
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.rl.trainer import check_model_folder

REPO = Path(__file__).resolve().parents[3]


def test_missing_model_folder_says_how_to_make_it(tmp_path):
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo.toml", [f'model.path="{tmp_path / "nope"}"'])
    with pytest.raises(FileNotFoundError, match=r"has no config.json; run the short demo SFT first: torchrun "
                                                r".*demo_sft.toml --set train.output_dir=runs/demo_sft_short"):
        check_model_folder(cfg)
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "config.json").write_text("{}")
    check_model_folder(cfg)  # present: no error


def test_missing_model_folder_without_hint(tmp_path):
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo.toml",
                      [f'model.path="{tmp_path / "nope"}"', 'rl.model_path_hint=""'])
    with pytest.raises(FileNotFoundError, match="GRPO starts from a trained model folder"):
        check_model_folder(cfg)
