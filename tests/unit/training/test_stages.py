"""`[[stages]]`: each stage's config (its keys in place, its folder, the previous stage's export as
the model) and the refusals of combinations that cannot work."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config_dict
from megatron_vlm.config.loader import to_dict
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.training.stages import stage_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launch"))
import pretrain_vlm  # noqa: E402

BASE = {"model": {"path": "/m", "synthesize": "tiny_internvl"}, "data": {"max_frames": 16, "image_root": "/d"},
        "train": {"output_dir": "/runs/c", "epochs": 1, "train_layers": ["^visual"]}, "optimizer": {"lr": 4e-5},
        "stages": [{"name": "s1", "train_path": "/d/1.jsonl", "max_frames": 4},
                   {"name": "s2", "train_path": "/d/2.jsonl", "eval_path": "/d/2v.jsonl", "max_frames": 10,
                    "max_tokens_per_pack": 8192, "max_steps": 7, "lr": 2e-5, "train_layers": []}]}


def test_stage_configs():
    cfg = load_config_dict(BASE)
    s1, s2 = (load_config_dict(stage_overrides(to_dict(cfg), cfg.stages, i)) for i in (0, 1))
    assert (s1.model.path, s1.model.synthesize, s1.train.output_dir) == ("/m", "tiny_internvl", "/runs/c/s1")
    assert (s1.data.train_path, s1.data.max_frames, s1.data.image_root, s1.optimizer.lr) == ("/d/1.jsonl", 4, "/d", 4e-5)
    assert (s1.train.epochs, s1.train.max_steps, s1.train.train_layers, s1.stages) == (1, None, ["^visual"], [])
    assert (s2.model.path, s2.model.synthesize, s2.train.output_dir) == ("/runs/c/s1/hf", None, "/runs/c/s2")
    assert (s2.data.train_path, s2.data.eval_path, s2.data.max_frames, s2.data.max_tokens_per_pack) == (
        "/d/2.jsonl", "/d/2v.jsonl", 10, 8192)
    assert (s2.train.max_steps, s2.train.epochs, s2.train.train_layers, s2.optimizer.lr) == (7, None, [], 2e-5)


@pytest.mark.parametrize("change, match", [
    ({"train": {"output_dir": "/r", "epochs": 1, "mode": "grpo"}, "rl": {}}, "stages: only SFT runs"),
    ({"checkpoint": {"export_hf": False}}, "checkpoint.export_hf"),
    ({"checkpoint": {"resume": "/ckpt/step_5"}}, "checkpoint.resume"),
    ({"stages": [{"name": "a", "train_path": "/x"}, {"name": "a", "train_path": "/y"}]}, "duplicate stage names"),
    ({"stages": [{"name": "a/b", "train_path": "/x"}]}, "stages\\[0\\].name"),
    ({"stages": [{"name": "a"}]}, "data.train_path: required"),
])
def test_stage_refusals(change, match):
    with pytest.raises(ConfigError, match=match):
        load_config_dict({**BASE, **change})


@pytest.mark.parametrize("stage_change, extra, match", [
    ({"train_layers": ["^visual"]}, {"lora": {"r": 4}}, r"^stages\[1\]\.train_layers: cannot be combined with \[lora\]"),
    ({"max_tokens_per_pack": 1}, {}, r"^stages\[1\]\.max_tokens_per_pack: must be >= 16"),
    ({"max_tokens_per_pack": 8194}, {"parallel": {"cp": 2}}, r"^stages\[1\]\.max_tokens_per_pack: .*divisible"),
])
def test_a_stage_error_names_the_stage_key(stage_change, extra, match, tmp_path, capsys):
    """A stage key that only fails in its stage's config (with a main-section key) is named as the
    user wrote it (`stages[1].train_layers`), at load / `--check`, before any stage trains."""
    stages = [BASE["stages"][0], {**BASE["stages"][1], **stage_change}]
    cfg = load_config_dict({**BASE, **extra, "train": {**BASE["train"], "train_layers": []}, "stages": stages})
    with pytest.raises(ConfigError, match=match):
        check_keys_for_mode(cfg)


def test_stage_error_exits_2_on_check(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "/m"\nsynthesize = "tiny_internvl"\n[data]\ntype = "messages_jsonl"\n'
                    f'[train]\noutput_dir = "{tmp_path}/r"\nmax_steps = 2\n[lora]\nr = 4\n'
                    '[[stages]]\nname = "a"\ntrain_path = "/x"\n[[stages]]\nname = "b"\ntrain_path = "/y"\n'
                    'train_layers = ["^visual"]\n')
    with pytest.raises(SystemExit) as e:
        pretrain_vlm.main(["--config", str(path), "--check", "--device-memory-gib", "80"])
    assert e.value.code == 2
    assert "config error: stages[1].train_layers: cannot be combined with [lora]" in capsys.readouterr().err


def test_lora_init_from_is_the_first_stage_start_only():
    """Stage 2 starts from stage 1's export, which already holds the `lora.init_from` adapter (merged
    with what stage 1 trained on it): loading that adapter again would apply it twice."""
    cfg = load_config_dict({**BASE, "train": {**BASE["train"], "train_layers": []},
                            "lora": {"r": 4, "init_from": "/a", "init_from_mode": "merge"}})
    s1, s2 = (load_config_dict(stage_overrides(to_dict(cfg), cfg.stages, i)) for i in (0, 1))
    assert (s1.lora.init_from, s1.lora.init_from_mode) == ("/a", "merge")
    assert (s2.lora.init_from, s2.lora.init_from_mode, s2.lora.r) == ("", "continue", 4)
