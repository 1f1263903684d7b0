"""The models table of the README and docs/models.md names what the code supports: each `model_type` is registered
(and every registered one is in the table), each transformers class it claims to match exists in transformers, and
each tiny demo config is in launch/configs/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from megatron_vlm.models.registry import supported_model_types

REPO = Path(__file__).resolve().parents[2]
HEADER = "| family | `model_type` (config.json) | transformers class it matches (logits, fp32) | tiny CPU demo |"


def table_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def table_problems(text: str, registered: set[str]) -> list[str]:
    bad, named = [], set()
    for family, types, classes, demos in table_rows(text):
        for t in re.findall(r"`([a-z0-9_]+)`", types.split("+")[0]):  # after "+": a vision_config value
            named.add(t)
            if t not in registered:
                bad.append(f"{family}: model_type {t} is not registered")
        for cls in re.findall(r"`([A-Z]\w+)`", classes):
            if not hasattr(transformers, cls):
                bad.append(f"{family}: transformers has no {cls}")
        for demo in re.findall(r"`([\w.]+\.toml)`", demos):
            if not (REPO / "launch" / "configs" / demo).is_file():
                bad.append(f"{family}: no launch/configs/{demo}")
    bad += [f"model_type {t} is registered but not in the table" for t in sorted(registered - named)]
    return bad


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_the_models_table_matches_the_code(page):
    assert table_problems((REPO / page).read_text(), set(supported_model_types())) == []


def test_the_checker_sees_a_wrong_row():
    table = HEADER + "\n|---|---|---|---|\n| A | `qwen2`, `qwen9` | `Qwen2ForCausalLM`, `Qwen9ForCausalLM` | `demo_nope.toml` |\n"
    assert table_problems(table, {"qwen2", "qwen3"}) == [
        "A: model_type qwen9 is not registered", "A: transformers has no Qwen9ForCausalLM", "A: no launch/configs/demo_nope.toml",
        "model_type qwen3 is registered but not in the table"]
