"""Tiny Qwen3-VL and InternVL processor / model folders (built offline by
`megatron_vlm.testing.tiny_processor_qwen3_vl` / `tiny_processor_internvl`) against transformers'
own processors:

* Qwen3-VL: the shared data pipeline (`load_processor` + `process_record`) on the tiny folder gives
  the input_ids, pixel_values and image_grid_thw of transformers' `Qwen3VLProcessor` + chat template
  (multi-turn, several images of different sizes, patch 16);
* both families: what transformers' processor produces from the tiny folder (Qwen3VLProcessor;
  InternVLProcessor with dynamic tiling + thumbnail) drives our model loaded from the folder and
  transformers' model loaded from the same folder to equal logits, so folder, processor settings
  (patch / merge sizes, tokens per tile) and model agree.

transformers builds these processors only together with a video processor, whose classes import
torchvision; as in the Qwen2.5-VL data tests, the `VideoProcessorMixin` lookup is satisfied with a
bare instance and no videos are given to the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.processor import load_processor

TOL = 1e-4


def _image(path, size, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def bare_video_processor(monkeypatch):
    import transformers.processing_utils as pu
    from transformers.video_processing_utils import VideoProcessorMixin

    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    return VideoProcessorMixin()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_folder

    return build_tiny_qwen3_vl_folder(tmp_path_factory.mktemp("q3") / "tiny-qwen3-vl", seed=0)


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_folder

    return build_tiny_internvl_folder(tmp_path_factory.mktemp("iv") / "tiny-internvl", seed=0)


def _qwen3_hf_processor(folder, video_processor):
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder), tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=video_processor, chat_template=(folder / "chat_template.jinja").read_text(),
    )


def _messages(paths):
    return [
        {"role": "user", "content": [{"type": "image", "image": str(paths[0])}, {"type": "text", "text": "What colour is it?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": str(paths[1])}]},
        {"role": "assistant", "content": "a blue square"},
    ]


def test_qwen3_vl_folder_layout(qwen3_dir):
    import json

    pre = json.loads((qwen3_dir / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 16 and pre["merge_size"] == 2 and pre["image_processor_type"] == "Qwen2VLImageProcessorFast"
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl" and cfg["vision_config"]["patch_size"] == 16


def test_qwen3_vl_shared_pipeline_matches_transformers_processor(qwen3_dir, bare_video_processor, tmp_path):
    paths = [_image(tmp_path / "a.png", (70, 50), 1), _image(tmp_path / "b.png", (130, 96), 2)]
    raw = _messages(paths)
    ours = process_record(Record(normalize_messages(raw), "mem", 1), load_processor(qwen3_dir), max_frames=4)
    hf_proc = _qwen3_hf_processor(qwen3_dir, bare_video_processor)
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    ref = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert ours.pixel_values.shape[-1] == 3 * 2 * 16 * 16


def test_qwen3_vl_processor_outputs_drive_both_models_equally(qwen3_dir, bare_video_processor, tmp_path):
    from transformers import AutoModelForImageTextToText

    from megatron_vlm.checkpoint import load_hf_model

    paths = [_image(tmp_path / "a.png", (64, 64), 3), _image(tmp_path / "b.png", (96, 64), 4)]
    hf_proc = _qwen3_hf_processor(qwen3_dir, bare_video_processor)
    text = hf_proc.apply_chat_template(_messages(paths), tokenize=False)
    batch = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    hf = AutoModelForImageTextToText.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    ours = load_hf_model(qwen3_dir).eval()
    with torch.no_grad():
        ref = hf(**batch).logits
        out = ours(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"])
    assert (ref - out).abs().max().item() <= TOL


def test_internvl_processor_tiles_drive_both_models_equally(internvl_dir, bare_video_processor, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from megatron_vlm.checkpoint import load_hf_model
    from megatron_vlm.testing.tiny_processor_internvl import TOKENS_PER_TILE

    tok = AutoTokenizer.from_pretrained(internvl_dir)
    hf_proc = InternVLProcessor(
        image_processor=GotOcr2ImageProcessorPil.from_pretrained(internvl_dir), tokenizer=tok,
        video_processor=bare_video_processor, image_seq_length=TOKENS_PER_TILE,
        chat_template=(internvl_dir / "chat_template.jinja").read_text(),
    )
    # 2:1 -> two tiles + thumbnail; square -> one tile, no thumbnail
    paths = [_image(tmp_path / "wide.png", (112, 56), 5), _image(tmp_path / "square.png", (56, 56), 6)]
    text = hf_proc.apply_chat_template(_messages(paths), tokenize=False)
    batch = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    assert batch["pixel_values"].shape == (4, 3, 56, 56)
    ids = batch["input_ids"][0]
    ctx = tok.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert int((ids == ctx).sum()) == 4 * TOKENS_PER_TILE
    assert int((ids == tok.convert_tokens_to_ids("<img>")).sum()) == 2 == int((ids == tok.convert_tokens_to_ids("</img>")).sum())

    hf = AutoModelForImageTextToText.from_pretrained(internvl_dir, dtype=torch.float32).eval()
    ours = load_hf_model(internvl_dir).eval()
    assert ours.args.image_token_id == ctx and ours.args.tokens_per_tile == TOKENS_PER_TILE
    with torch.no_grad():
        ref = hf(**batch).logits
        out = ours(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])
    assert (ref - out).abs().max().item() <= TOL
