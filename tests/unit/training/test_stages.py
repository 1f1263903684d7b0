"""`[[stages]]`: each stage's config (its keys in place, its folder, the previous stage's export as
the model) and the refusals of combinations that cannot work."""
from __future__ import annotations

import pytest

from megatron_vlm.config import ConfigError, load_config_dict
from megatron_vlm.config.loader import to_dict
from megatron_vlm.training.stages import stage_overrides

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
