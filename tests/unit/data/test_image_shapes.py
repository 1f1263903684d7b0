"""An image shape the model's image processor refuses is a named bad record, not an unexpected error.

transformers' Qwen-VL `smart_resize` raises ValueError for an aspect ratio over 200 (a 4000 x 3 strip),
and Nemotron-H Omni's `get_patch_grid_size` divides by zero when a thin image scales to 0 patches on
one side; jobs counted them as "unexpected_error" and logged a traceback as a possible bug. They are
now "unsupported_shape", decided by the same rules (the reference: transformers fails exactly when we
refuse, and agrees on the size otherwise). Qwen-VL here; Nemotron-VL in test_processor_nemotron_vl.py,
where transformers' torchvision-backed module can be imported.
"""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.processor_qwen_vl import _smart_resize


@pytest.mark.parametrize("hw", [(3, 600), (3, 601), (600, 3), (601, 3), (1, 200), (1, 201), (1, 1), (28, 5600), (27, 5600)])
def test_same_rule_as_transformers_smart_resize(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        expected = smart_resize(*hw, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    except ValueError as e:
        assert "aspect ratio" in str(e)
        with pytest.raises(BadRecordError, match="aspect ratio .* over 200") as got:
            _smart_resize(*hw, 28, 56 * 56, 28 * 28 * 1280)
        assert got.value.category == "unsupported_shape"
    else:
        assert _smart_resize(*hw, 28, 56 * 56, 28 * 28 * 1280) == expected


def test_a_strip_image_is_one_counted_bad_record(tmp_path, proc, write_image):
    write_image(tmp_path / "strip.png", size=(4000, 3))
    write_image(tmp_path / "edge.png", size=(600, 3))  # ratio exactly 200: allowed
    lines = [json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                                   {"type": "text", "text": "q"}]},
                                      {"role": "assistant", "content": "a"}]}) + "\n" for name in ("edge.png", "strip.png")]
    (tmp_path / "d.jsonl").write_text("".join(lines))
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "d.jsonl"), num_workers=0, max_tokens_per_pack=4096)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert [(b.index, b.category) for b in loader.bad_records.entries] == [(2, "unsupported_shape")]
    assert int(next(iter(loader))["num_samples"]) == 1

