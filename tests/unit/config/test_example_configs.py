"""Every shipped launch config loads through the strict loader (a renamed key breaks this test)."""
from pathlib import Path

import pytest

from megatron_vlm.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "launch" / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.mode in ("sft", "grpo", "dpo", "reward")
