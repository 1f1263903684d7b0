"""The tiny Qwen2.5-VL tokenizer / processor folder: loadable offline by transformers, Qwen2.5-VL's
special tokens and chat-template format, byte-level round trips, deterministic files."""
from __future__ import annotations

import json

import pytest

from megatron_vlm.testing.tiny_processor import (
    SPECIAL_TOKENS,
    build_tiny_qwen2_5_vl_processor,
    tiny_qwen2_5_vl_text_config_ids,
)


def test_folder_loads_with_transformers_and_has_qwen_special_tokens(tiny_dir, proc):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    base = min(ids)
    assert ids == list(range(base, base + len(SPECIAL_TOKENS))) and len(tok) == base + len(SPECIAL_TOKENS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in SPECIAL_TOKENS:  # each special token is one token, never split
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]
    ip = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (14, 2, 2)
    assert json.loads((tiny_dir / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    video = json.loads((tiny_dir / "video_preprocessor_config.json").read_text())
    assert (proc.video_min_pixels, proc.video_max_pixels) == (video["size"]["shortest_edge"], video["size"]["longest_edge"])


@pytest.mark.parametrize("text", ["What colour is the circle?", "  x\n\ny\t", "Ünïcödé ✓ 数学 3.14159", ""])
def test_byte_level_round_trip(proc, text):
    tok = proc.tokenizer
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_task_words_are_single_tokens(proc):
    tok = proc.tokenizer
    assert len(tok("What colour is the circle?", add_special_tokens=False)["input_ids"]) == 6
    for answer in ("red", "purple", "triangle", "3"):
        assert len(tok(answer, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_follows_qwen2_5_vl_format(proc):
    msgs = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Hi?"}]},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": [{"type": "video", "video": ["f.png"]}, {"type": "image"}, {"type": "text", "text": "And?"}]}]
    vis = "<|vision_start|><|image_pad|><|vision_end|>"
    vid = "<|vision_start|><|video_pad|><|vision_end|>"
    assert proc.render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{vis}Hi?<|im_end|>\n"
        "<|im_start|>assistant\nYes.<|im_end|>\n"
        f"<|im_start|>user\n{vid}{vis}And?<|im_end|>\n"
        "<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Q"}]
    assert proc.render(own_system) == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
    labelled = proc.tokenizer.apply_chat_template(msgs[:1], chat_template=proc.chat_template, tokenize=False,
                                                  add_vision_id=True)
    assert f"Picture 1: {vis}Hi?" in labelled


def test_config_ids_and_deterministic_files(tmp_path, tiny_dir, proc):
    from transformers import Qwen2_5_VLConfig

    ids = tiny_qwen2_5_vl_text_config_ids(proc)
    tok = proc.tokenizer
    assert ids["image_token_id"] == proc.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert ids["video_token_id"] == proc.video_token_id and ids["vision_start_token_id"] == proc.vision_start_token_id
    assert ids["eos_token_id"] == tok.eos_token_id and ids["pad_token_id"] == tok.pad_token_id
    assert ids["vocab_size"] % 64 == 0 and len(tok) <= ids["vocab_size"] < len(tok) + 64
    cfg = Qwen2_5_VLConfig(text_config={"vocab_size": ids["vocab_size"]}, image_token_id=ids["image_token_id"],
                           video_token_id=ids["video_token_id"], vision_start_token_id=ids["vision_start_token_id"])
    assert cfg.image_token_id == ids["image_token_id"]
    build_tiny_qwen2_5_vl_processor(tmp_path / "again")
    for name in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    extra = build_tiny_qwen2_5_vl_processor(tmp_path / "extra", extra_words=["zyxwvut"])
    assert len(extra.tokenizer("zyxwvut", add_special_tokens=False)["input_ids"]) == 1


def test_load_processor_errors_name_the_problem(tmp_path, tiny_dir):
    from megatron_vlm.data.processor import load_processor

    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json"):
        load_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "InternVLImageProcessor"}))
    with pytest.raises(NotImplementedError, match="InternVLImageProcessor"):
        load_processor(tmp_path)
    with pytest.raises(ValueError, match="image min_pixels 5000 is larger than max_pixels 4000"):
        load_processor(tiny_dir, min_pixels=5000, max_pixels=4000)
