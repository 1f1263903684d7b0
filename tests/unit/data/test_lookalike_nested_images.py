"""The processor look-alike takes images nested per text, as transformers' processors do.

TRL's vision collator (and most batch code) calls `processor(text=texts, images=[[images of text 0], [images of
text 1], ...])`; transformers' Qwen2.5-VL processor flattens the nesting. Ours failed on the inner lists
(`to_rgb` of a list). Reference: transformers' own `Qwen2_5_VLProcessor` on the same nested call.
"""
from __future__ import annotations

import torch
from PIL import Image


def test_images_nested_per_text_match_transformers(proc, hf_processor, tmp_path, write_image):
    imgs = [Image.open(write_image(tmp_path / f"{i}.png", size=(56 + 28 * i, 56), seed=i)).convert("RGB")
            for i in range(3)]
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    texts = [f"{pad}one{pad}", "none", f"two {pad}"]
    nested = [[imgs[0], imgs[1]], [], [imgs[2]]]
    ours = proc(text=texts, images=nested, padding=True)
    ref = hf_processor(text=texts, images=nested, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "image_grid_thw"):
        assert torch.equal(ours[key], ref[key]), key
    torch.testing.assert_close(ours["pixel_values"], ref["pixel_values"].float(), rtol=0, atol=0)


def test_tokenizer_options_are_applied_not_dropped(proc, hf_processor, tmp_path, write_image):
    """truncation / max_length / pad_to_multiple_of reach the tokenizer (they were swallowed, so a caller's
    length cap silently did nothing); truncation that cuts image tokens is an error, as in transformers."""
    import pytest

    img = Image.open(write_image(tmp_path / "a.png", size=(56, 56), seed=0)).convert("RGB")
    texts = ["<|vision_start|><|image_pad|><|vision_end|>" + " one two three four five six" * 4]
    for kw in ({"truncation": True, "max_length": 20}, {"padding": True, "pad_to_multiple_of": 64}):
        ours = proc(text=texts, images=[img], **kw)
        ref = hf_processor(text=texts, images=[img], return_tensors="pt", **kw)
        assert torch.equal(ours["input_ids"], ref["input_ids"]), kw
        assert torch.equal(ours["attention_mask"], ref["attention_mask"]), kw
    with pytest.raises(ValueError, match="image"):
        hf_processor(text=texts, images=[img], return_tensors="pt", truncation=True, max_length=4)
    with pytest.raises(ValueError, match="image"):
        proc(text=texts, images=[img], truncation=True, max_length=4)
