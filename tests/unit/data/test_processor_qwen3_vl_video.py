"""Qwen3-VL videos in the shared data pipeline against transformers' `Qwen3VLProcessor` with its own
`Qwen3VLVideoProcessor`.

transformers' video processor is a torchvision-backend class; without torchvision it runs up to
two calls: converting to RGB (skipped: `do_convert_rgb=False`, the frames are RGB already) and
`normalize`, supplied here by a stand-in with torchvision's float semantics ((x - mean) / std per
channel). Frames are given at a size the resize rule keeps (`do_resize=False` in the reference;
ours resizes to the same size, a no-op), so everything else is transformers' code: the 3-D resize
rule, frame pairing and patch layout, `<t seconds>` timestamps from the video metadata, the
placeholder expansion, mm_token_type_ids. The resize rule itself is compared with the video
processor's `get_num_of_video_patches` over many clip shapes. Also: exact length planning, the
labels mask, and our processor's video outputs driving transformers' Qwen3-VL model and ours to
equal logits, packed and per sample."""
from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.packing import collate_pack
from megatron_vlm.data.processing import estimate_length, process_record
from megatron_vlm.data.processor import load_processor

VIDEO_PIXELS = {"shortest_edge": 64 * 64, "longest_edge": 4 * 64 * 64}  # whole-clip limits (t x h x w)


def _image(path, size, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_folder

    return build_tiny_qwen3_vl_folder(tmp_path_factory.mktemp("q3v") / "tiny-qwen3-vl", seed=0)


@pytest.fixture(scope="module")
def proc(qwen3_dir):
    return load_processor(qwen3_dir, video_min_pixels=VIDEO_PIXELS["shortest_edge"],
                          video_max_pixels=VIDEO_PIXELS["longest_edge"])


@pytest.fixture
def hf_proc(qwen3_dir, monkeypatch):
    import transformers.image_processing_backends as backends
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    def normalize(t, mean, std, inplace=False):
        mean, std = torch.as_tensor(mean, dtype=t.dtype), torch.as_tensor(std, dtype=t.dtype)
        return (t - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)

    monkeypatch.setattr(backends, "tvF", types.SimpleNamespace(normalize=normalize), raising=False)
    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    vid = json.loads((qwen3_dir / "video_preprocessor_config.json").read_text())
    vid = {k: v for k, v in vid.items() if k not in ("video_processor_type", "processor_class")}
    vid["size"] = dict(VIDEO_PIXELS)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(qwen3_dir),
        tokenizer=AutoTokenizer.from_pretrained(qwen3_dir), video_processor=Qwen3VLVideoProcessor(**vid),
        chat_template=(qwen3_dir / "chat_template.jinja").read_text())


def _hf_video_kwargs(total, fps, indices):
    from transformers.video_utils import VideoMetadata

    return {"do_resize": False, "do_convert_rgb": False, "cap_pixels_per_frame": False,
            "video_metadata": [VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(indices))]}


def test_clip_resize_rule_matches_transformers_video_processor(proc, hf_proc):
    rng = np.random.default_rng(0)
    shapes = [(1 + int(rng.integers(0, 12)), int(rng.integers(20, 400)), int(rng.integers(20, 400))) for _ in range(150)]
    capped = copy.copy(proc)
    capped.cap_pixels_per_frame, capped.max_video_tokens = True, 2
    vp = hf_proc.video_processor
    for n, h, w in shapes + [(2, 64, 64), (3, 32, 300)]:
        if n < 2:
            continue  # transformers rejects one-frame clips; we size them as two frames
        for p, cap in ((proc, False), (capped, True)):
            kw = {"size": dict(VIDEO_PIXELS), "cap_pixels_per_frame": cap}
            if cap:
                vp.max_video_tokens = 2
            t, gh, gw = p.video_grid_thw(n, h, w)
            assert t * gh * gw == vp.get_num_of_video_patches(n, h, w, kw), (n, h, w, cap)
            vp.max_video_tokens = 768
    assert proc.video_grid_thw(1, 64, 64) == proc.video_grid_thw(2, 64, 64)


def test_image_and_video_record_matches_transformers_processor(proc, hf_proc, tmp_path):
    frames = [_image(tmp_path / f"f{i}.png", (64, 64), 10 + i) for i in range(5)]
    img = _image(tmp_path / "a.png", (70, 50), 1)
    raw = [
        {"role": "user", "content": [{"type": "image", "image": img}, {"type": "video", "video": frames, "fps": 3.0},
                                     {"type": "text", "text": "What happens after the picture?"}]},
        {"role": "assistant", "content": "the robot picks up the cup"},
    ]
    rec = Record(normalize_messages(raw), "mem", 1)
    ours = process_record(rec, proc, max_frames=3)  # 5 frames -> 0, 2, 4 (odd: the last is repeated)
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    ref = hf_proc(text=[text], images=[Image.open(img).convert("RGB")],
                  videos=[[Image.open(frames[i]).convert("RGB") for i in (0, 2, 4)]],
                  videos_kwargs=_hf_video_kwargs(5, 3.0, [0, 2, 4]), return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert "<|vision_start|><0.3 seconds><|vision_start|>" in proc.tokenizer.decode(ours.input_ids)
    assert torch.equal(ours.video_grid_thw, ref["video_grid_thw"]) and ours.video_grid_thw.tolist() == [[2, 4, 4]]
    torch.testing.assert_close(ours.pixel_values_videos, ref["pixel_values_videos"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert ours.second_per_grid_ts is None
    assert torch.equal(proc.mm_token_type_ids(ours.input_ids), ref["mm_token_type_ids"][0])
    assert estimate_length(rec, proc, max_frames=3) == len(ours)
    assert proc.tokenizer.decode(ours.input_ids[ours.label_mask]) == "the robot picks up the cup<|im_end|>"


def test_lookalike_call_matches_transformers_processor(proc, hf_proc, tmp_path):
    frames = [Image.open(_image(tmp_path / f"g{i}.png", (64, 64), 30 + i)).convert("RGB") for i in range(4)]
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    ours = proc(text=text, videos=[frames], fps=4.0)
    ref = hf_proc(text=[text], videos=[frames], videos_kwargs=_hf_video_kwargs(4, 4.0, range(4)), return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "video_grid_thw"):
        assert torch.equal(ours[key], ref[key]), key
    torch.testing.assert_close(ours["pixel_values_videos"], ref["pixel_values_videos"], rtol=0, atol=1e-6)


def test_video_samples_drive_transformers_and_our_model_equally(proc, qwen3_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from megatron_vlm.checkpoint import load_hf_model
    from megatron_vlm.testing.tiny_processor_qwen3_vl import randomize_constants_

    hf = AutoModelForImageTextToText.from_pretrained(qwen3_dir, dtype=torch.float32, attn_implementation="eager")
    randomize_constants_(hf, seed=1)  # norms / biases are constants in a fresh model: make mis-mapping visible
    hf.save_pretrained(tmp_path / "randomised")
    hf.eval()
    ours = load_hf_model(tmp_path / "randomised").eval()
    frames = [_image(tmp_path / f"h{i}.png", (96, 64), 40 + i) for i in range(3)]
    records = [
        [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0}, {"type": "text", "text": "what?"}]},
         {"role": "assistant", "content": "a cup"}],
        [{"role": "user", "content": "no video"}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": [{"type": "image", "image": _image(tmp_path / "i.png", (64, 96), 5)},
                                      {"type": "video", "video": frames[:2]}]},
         {"role": "assistant", "content": "same"}],
    ]
    samples = [process_record(Record(normalize_messages(r), "mem", i), proc, max_frames=4) for i, r in enumerate(records)]
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    with torch.no_grad():
        single = []
        for s in samples:
            vision = {k: getattr(s, k) for k in keys if getattr(s, k) is not None}
            ids = s.input_ids[None]
            ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=proc.mm_token_type_ids(ids),
                     **vision).logits[0]
            out = ours(ids, torch.ones_like(ids), **vision)[0]
            assert (ref - out).abs().max().item() <= 1e-4
            single.append(out)
        pack = collate_pack(samples)
        packed = ours(pack["input_ids"], cu_seqlens=pack["cu_seqlens"], **{k: pack[k] for k in keys if k in pack})[0]
    torch.testing.assert_close(packed, torch.cat(single), rtol=1e-4, atol=1e-4)
