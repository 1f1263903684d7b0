"""Image items as the public message formats write them: transformers' own ({"type": "image", "url" | "path" |
"base64": ...}, what `apply_chat_template` loads) and qwen-vl-utils' ("file:///abs/x.png", the local-file form of
Qwen-VL's documentation). Each must give the tokens and pixels transformers gives for the same conversation; they
were refused ("an image item has no path", "file not found: file://...") or, beside a top-level "images", filled
from it."""
from __future__ import annotations

import base64

import pytest
import torch

from megatron_vlm.data.processing import process_record


def _reference(hf_processor, messages):
    return hf_processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


@pytest.mark.parametrize("key", ["url", "path", "base64", "file_url"])
def test_image_item_keys_load_as_transformers_loads_them(key, proc, hf_processor, messages_record, tmp_path):
    png = tmp_path / "x.png"  # written by messages_record: 56 x 56, random pixels
    value = {"url": str(png), "path": str(png), "base64": base64.b64encode(png.read_bytes()).decode(),
             "file_url": f"file://{png}"}[key]
    item = {"type": "image", "image": value} if key == "file_url" else {"type": "image", key: value}
    rec = messages_record({"messages": [{"role": "user", "content": [item, {"type": "text", "text": "What?"}]},
                                        {"role": "assistant", "content": "A square."}]})
    ours = process_record(rec, proc, max_frames=4)
    ref_item = {"type": "image", "path": str(png)}  # transformers reads no file:// URL: the same file by its path
    ref = _reference(hf_processor, [{"role": "user", "content": [ref_item, {"type": "text", "text": "What?"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}])
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)


def test_relative_url_resolves_like_an_image_path(messages_record, tmp_path):
    rec = messages_record({"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                                       {"role": "assistant", "content": "ok"}]})
    assert rec.images() == [str(tmp_path / "x.png")]


def test_bad_base64_item_is_a_corrupt_image(messages_record):
    from megatron_vlm.data.bad_records import BadRecordError

    with pytest.raises(BadRecordError) as e:
        messages_record({"messages": [{"role": "user", "content": [{"type": "image", "base64": "not base64!"}]},
                                      {"role": "assistant", "content": "ok"}]})
    assert e.value.category == "corrupt_image"
