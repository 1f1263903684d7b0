"""Shared fixture of the eval tests: the tiny Qwen2.5-VL processor, built once per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def proc(tmp_path_factory):
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor

    d = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    build_tiny_qwen2_5_vl_processor(d)
    return load_processor(d)
