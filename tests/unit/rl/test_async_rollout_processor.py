"""An asynchronous rollout rank loads the processor the trainer loads, `[data]` video pixel limits included.

Found by a processor review: the rollout ranks passed only the image limits, so with `data.video_max_pixels` set
they sized video prompts (frames, tokens) differently from the training ranks, which re-encode the same prompts
for the update."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.rl.asynchronous import rollout_rank

CONFIG = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_grpo_async.toml"


class _Loaded(Exception):
    pass


def test_rollout_rank_processor_takes_every_pixel_limit(monkeypatch, tmp_path):
    cfg = load_config(CONFIG, [f'model.path="{tmp_path}"', "data.min_pixels=3136", "data.max_pixels=12544",
                               "data.video_min_pixels=6272", "data.video_max_pixels=25088",
                               "data.chat_template_kwargs.enable_thinking=false"])
    seen = {}

    def load_processor(path, **kwargs):
        seen.update(kwargs, path=path)
        raise _Loaded

    monkeypatch.setattr(rollout_rank, "load_processor", load_processor)
    bridge = types.SimpleNamespace(broadcast_object=lambda *a: {"start_step": 0, "total_steps": 1, "num_prompts": 1})
    ctx = types.SimpleNamespace(cfg=cfg, env=types.SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(_Loaded):
        rollout_rank.run_rollout_rank(ctx, types.SimpleNamespace(bridge=bridge))
    assert seen == {"path": str(tmp_path), "min_pixels": 3136, "max_pixels": 12544,
                    "video_min_pixels": 6272, "video_max_pixels": 25088,
                    "chat_template_kwargs": {"enable_thinking": False}}
