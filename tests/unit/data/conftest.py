"""Shared fixtures of the data tests: the tiny Qwen2.5-VL processor folder (built once per session),
small image writers, and the transformers reference processor."""
from __future__ import annotations

import pytest
from PIL import Image


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor

    d = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    build_tiny_qwen2_5_vl_processor(d)
    return d


@pytest.fixture(scope="session")
def proc(tiny_dir):
    from megatron_vlm.data.processor import load_processor

    return load_processor(tiny_dir)


def _write_image(path, size=(56, 56), colour=(200, 30, 30), seed=None):
    """An RGB PNG; with `seed` the pixels are random (so resize / layout errors cannot hide)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    if seed is None:
        img = Image.new("RGB", size, colour)
    else:
        rng = np.random.default_rng(seed)
        img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    img.save(path)
    return path


@pytest.fixture(scope="session")
def write_image():
    return _write_image


@pytest.fixture
def messages_record(tmp_path):
    """`record(row)`: a messages-JSONL line (a dict, through JSON as a file holds it) as the reader makes it, its
    relative paths resolved in `tmp_path`, where `x.png` (56 x 56, random pixels) is written."""
    import json

    from megatron_vlm.data.messages import record_from_messages_row

    _write_image(tmp_path / "x.png", size=(56, 56), seed=0)
    return lambda row: record_from_messages_row(json.loads(json.dumps(row)), lambda r: str(tmp_path / r), source="t",
                                                index=1)


@pytest.fixture
def hf_processor(tiny_dir, monkeypatch):
    """transformers' own Qwen2_5_VLProcessor over the tiny folder's tokenizer, image processor and
    chat template. transformers cannot build it without torchvision only because it looks up the
    `VideoProcessorMixin` base class by name; we expose that class for the duration of the test and
    pass a bare video processor (no video inputs are given to the reference)."""
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import VideoProcessorMixin

    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(tiny_dir),
        tokenizer=AutoTokenizer.from_pretrained(tiny_dir),
        video_processor=VideoProcessorMixin(),
        chat_template=(tiny_dir / "chat_template.jinja").read_text(),
    )
