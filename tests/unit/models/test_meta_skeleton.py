"""`build_model` under the meta device (the `--check` skeleton) has the CPU build's parameters, shapes and ties.

It skips the random init there (no values to draw; torch's Python decompositions made it most of a `--check`), so
the ties `init_weights` would restore must come from the build itself: a tied checkpoint's embedding and lm_head
are one parameter in both builds (parameter counts and memory plans count it once)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.testing.synthesize import synthesize_model_folder


def _layout(model: torch.nn.Module) -> tuple[list[tuple[str, tuple[int, ...]]], list[list[str]]]:
    """(every parameter name with its shape, tied ones included; the groups of names sharing one parameter)."""
    named = list(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, p in named:
        groups.setdefault(id(p), []).append(name)
    return [(n, tuple(p.shape)) for n, p in named], sorted(sorted(g) for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("name,tie", [("tiny_qwen2_5_vl", True), ("tiny_qwen3_vl_moe", False),
                                      ("tiny_nemotron_vl", False), ("tiny_qwen3", True)])
def test_meta_build_has_the_cpu_builds_parameters_and_ties(tmp_path, name, tie):
    folder = synthesize_model_folder(name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = tie
    if "text_config" in config:
        config["text_config"]["tie_word_embeddings"] = tie
    cpu = build_model(config)
    with torch.device("meta"):
        meta = build_model(config)
    assert all(p.is_meta for p in meta.parameters())
    want, got = _layout(cpu), _layout(meta)
    assert got == want
    assert bool(want[1]) == tie, want[1]  # the tied case really ties (the comparison is not of two untied builds)
