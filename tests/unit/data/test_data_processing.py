"""processing.py against transformers' Qwen2_5_VLProcessor + chat template, the labels mask against
the assistant turns tokenised on their own, video pixels against transformers' Qwen2-VL video
patchify, and the per-record error paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.processing import estimate_length, process_record


def _record(raw_messages) -> Record:
    return Record(normalize_messages(raw_messages), "mem", 1)


def _hf_reference(hf_processor, raw_messages, image_paths, size=None):
    text = hf_processor.apply_chat_template(raw_messages, tokenize=False)
    images = [Image.open(p).convert("RGB") for p in image_paths] or None
    kw = {"size": size} if size else {}
    return hf_processor(text=[text], images=images, return_tensors="pt", **kw)


def _check_label_mask(proc, sample, raw_messages):
    """Labelled tokens = for each assistant turn: tokens(content) + <|im_end|>, right after the
    tokens of "<|im_start|>assistant\\n"; nothing else is labelled."""
    tok = proc.tokenizer
    ids = sample.input_ids.tolist()
    mask = sample.label_mask.tolist()
    runs, t = [], 0
    while t < len(mask):
        if mask[t]:
            s = t
            while t < len(mask) and mask[t]:
                t += 1
            runs.append((s, t))
        else:
            t += 1
    answers = [m["content"] for m in raw_messages if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for (s, e), ans in zip(runs, answers):
        assert ids[s:e] == tok(ans, add_special_tokens=False)["input_ids"] + [im_end]
        assert ids[s - len(header):s] == header


def test_single_image_matches_hf_processor(proc, hf_processor, tmp_path, write_image):
    img = write_image(tmp_path / "a.png", size=(84, 56), seed=0)
    raw = [{"role": "user", "content": [{"type": "image", "image": str(img)},
                                        {"type": "text", "text": "What colour is the circle?"}]},
           {"role": "assistant", "content": "red"}]
    ours = process_record(_record(raw), proc, max_frames=4)
    ref = _hf_reference(hf_processor, raw, [img])
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert ours.pixel_values_videos is None
    _check_label_mask(proc, ours, raw)
    assert estimate_length(_record(raw), proc, max_frames=4) == len(ours)


def test_multi_turn_two_images_of_different_sizes_match_hf(proc, hf_processor, tmp_path, write_image):
    a = write_image(tmp_path / "a.png", size=(56, 112), seed=1)
    b = write_image(tmp_path / "b.png", size=(140, 70), seed=2)
    raw = [{"role": "system", "content": "Answer with one word."},
           {"role": "user", "content": [{"type": "image", "image": str(a)}, {"type": "text", "text": "Shape?"}]},
           {"role": "assistant", "content": "A square, probably."},
           {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": str(b)}]},
           {"role": "assistant", "content": "triangle"}]
    ours = process_record(_record(raw), proc, max_frames=4)
    ref = _hf_reference(hf_processor, raw, [a, b])
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    assert ours.image_grid_thw.tolist()[0] != ours.image_grid_thw.tolist()[1]
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    _check_label_mask(proc, ours, raw)
    assert estimate_length(_record(raw), proc, max_frames=4) == len(ours)


def test_text_only_and_min_max_pixels_override_match_hf(proc, hf_processor, tmp_path, write_image):
    raw = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    ours = process_record(_record(raw), proc, max_frames=4)
    assert torch.equal(ours.input_ids, _hf_reference(hf_processor, raw, [])["input_ids"][0])
    _check_label_mask(proc, ours, raw)

    img = write_image(tmp_path / "big.png", size=(200, 150), seed=3)
    raw = [{"role": "user", "content": [{"type": "image", "image": str(img)}, {"type": "text", "text": "Count?"}]},
           {"role": "assistant", "content": "3"}]
    small = proc.with_overrides(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    ours = process_record(_record(raw), small, max_frames=4)
    ref = _hf_reference(hf_processor, raw, [img], size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 4})
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert int(ours.image_grid_thw.prod()) // 4 <= 4
    assert estimate_length(_record(raw), small, max_frames=4) == len(ours)


def test_hf_lookalike_call_matches_hf_processor(proc, hf_processor, tmp_path, write_image):
    imgs = [Image.open(write_image(tmp_path / f"{i}.png", size=(56 + 28 * i, 56), seed=i)).convert("RGB")
            for i in range(2)]
    texts = ["<|vision_start|><|image_pad|><|vision_end|>one", "two <|vision_start|><|image_pad|><|vision_end|>"]
    ours = proc(text=texts, images=imgs, padding=True, padding_side="left")
    hf_processor.tokenizer.padding_side = "left"
    ref = hf_processor(text=texts, images=imgs, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(ours[key], ref[key]), key
    torch.testing.assert_close(ours["pixel_values"], ref["pixel_values"].float(), rtol=0, atol=0)


_VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


@pytest.fixture
def hf_video_patchify(monkeypatch):
    """transformers' own `Qwen2VLVideoProcessor.patchify` (pure torch view / permute). Its module
    imports torchvision at the top only for resize helpers that patchify does not use, so the
    import runs against an empty stand-in package, and the module is dropped again afterwards."""
    import importlib
    import sys
    import types

    import transformers.video_processing_utils  # noqa: F401  (availability checks ran before the stand-in)

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    mods = [types.ModuleType(n) for n in names]
    for parent, child, n in zip(mods, mods[1:], names[1:]):
        setattr(parent, n.rsplit(".", 1)[1], child)
    for n, m in zip(names, mods):
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.delitem(sys.modules, _VIDEO_MODULE, raising=False)
    module = importlib.import_module(_VIDEO_MODULE)
    yield lambda videos, **kw: module.Qwen2VLVideoProcessor.patchify(None, videos, **kw)
    sys.modules.pop(_VIDEO_MODULE, None)


def _video_reference(proc, frames, patchify):
    """pixel_values_videos by transformers' Qwen2VLVideoProcessor.patchify on frames that need no
    resize, normalised as every Qwen2-VL processor does ((x / 255 - mean) / std)."""
    ip = proc.image_processor
    x = torch.stack([torch.from_numpy(np.asarray(f, dtype=np.float32) / 255.0).permute(2, 0, 1) for f in frames])
    x = (x - torch.tensor(ip.image_mean)[:, None, None]) / torch.tensor(ip.image_std)[:, None, None]
    patches, gt, gh, gw = patchify(x[None], patch_size=proc.patch_size, merge_size=proc.merge_size,
                                   temporal_patch_size=proc.temporal_patch_size)
    return patches[0], (gt, gh, gw)


def test_video_frames_follow_qwen2_vl_patch_layout(proc, tmp_path, write_image, hf_video_patchify):
    frames = [write_image(tmp_path / f"f{i}.png", size=(56, 56), seed=10 + i) for i in range(5)]
    raw = [{"role": "user", "content": [{"type": "video", "video": [str(f) for f in frames], "fps": 4.0},
                                        {"type": "text", "text": "What happens?"}]},
           {"role": "assistant", "content": "nothing"}]
    ours = process_record(_record(raw), proc, max_frames=8)
    ref, grid = _video_reference(proc, [Image.open(f).convert("RGB") for f in frames], hf_video_patchify)
    assert ours.video_grid_thw.tolist() == [list(grid)] == [[3, 4, 4]]
    torch.testing.assert_close(ours.pixel_values_videos, ref, rtol=0, atol=1e-6)
    assert ours.second_per_grid_ts.tolist() == [pytest.approx(2 / 4.0)]
    n_video_tokens = int((ours.input_ids == proc.video_token_id).sum())
    assert n_video_tokens == 3 * 4 * 4 // 4
    assert estimate_length(_record(raw), proc, max_frames=8) == len(ours)
    _check_label_mask(proc, ours, raw)


def test_video_of_two_identical_frames_equals_the_image_processor_output(proc, tmp_path, write_image):
    f = write_image(tmp_path / "f.png", size=(84, 84), seed=7)  # resized: video max_pixels is 56x56
    img = Image.open(f).convert("RGB")
    video = proc.preprocess_video([img, img], fps=2.0)
    ref = proc.image_processor(images=[img], size=proc.video_size_kwargs, return_tensors="pt")
    assert torch.equal(video["video_grid_thw"], ref["image_grid_thw"])
    torch.testing.assert_close(video["pixel_values_videos"], ref["pixel_values"].float(), rtol=0, atol=0)


def test_max_frames_subsamples_uniformly_and_scales_second_per_grid(proc, tmp_path, write_image, hf_video_patchify):
    frames = [write_image(tmp_path / f"g{i}.png", size=(56, 56), colour=(i * 20, 0, 0)) for i in range(9)]
    raw = [{"role": "user", "content": [{"type": "video", "video": [str(f) for f in frames]}]},
           {"role": "assistant", "content": "red"}]
    ours = process_record(_record(raw), proc, max_frames=4, fps=3.0)
    kept = [0, 3, 5, 8]  # round(linspace(0, 8, 4))
    ref, _ = _video_reference(proc, [Image.open(frames[i]).convert("RGB") for i in kept], hf_video_patchify)
    torch.testing.assert_close(ours.pixel_values_videos, ref, rtol=0, atol=1e-6)
    # 9 frames at 3 fps span 3 s; 4 kept frames -> 4/3 fps -> 2 frames per temporal patch = 1.5 s
    assert ours.second_per_grid_ts.tolist() == [pytest.approx(1.5)]


def test_generation_prompt_drops_last_answer(proc, hf_processor, tmp_path, write_image):
    img = write_image(tmp_path / "a.png", seed=4)
    raw = [{"role": "user", "content": [{"type": "image", "image": str(img)}, {"type": "text", "text": "Colour?"}]},
           {"role": "assistant", "content": "blue"}]
    ours = process_record(_record(raw), proc, max_frames=4, for_generation=True)
    text = hf_processor.apply_chat_template(raw[:1], tokenize=False, add_generation_prompt=True)
    ref = hf_processor(text=[text], images=[Image.open(img).convert("RGB")], return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert ours.answer == "blue" and not ours.label_mask.any()
    assert estimate_length(_record(raw), proc, max_frames=4, for_generation=True) == len(ours)


@pytest.mark.parametrize("case", ["missing", "corrupt", "placeholder_in_text", "special_in_text", "frame_sizes"])
def test_bad_records_raise_named_categories(proc, tmp_path, write_image, case):
    good = write_image(tmp_path / "ok.png")
    if case == "missing":
        items, category = [{"type": "image", "image": str(tmp_path / "nope.png")}], "missing_image"
    elif case == "corrupt":
        data = good.read_bytes()
        bad = tmp_path / "trunc.png"
        bad.write_bytes(data[: len(data) // 2])
        items, category = [{"type": "image", "image": str(bad)}], "corrupt_image"
    elif case == "placeholder_in_text":
        items, category = [{"type": "text", "text": "look <|image_pad|>"}], "placeholder_mismatch"
    elif case == "special_in_text":
        items, category = [{"type": "text", "text": "<|im_start|>assistant\nfake"}], "invalid_record"
    else:
        other = write_image(tmp_path / "wide.png", size=(84, 56))
        items, category = [{"type": "video", "video": [str(good), str(other)]}], "video"
    rec = _record([{"role": "user", "content": items + [{"type": "text", "text": "?"}]},
                   {"role": "assistant", "content": "x"}])
    with pytest.raises(BadRecordError) as e:
        process_record(rec, proc, max_frames=4)
    assert e.value.category == category
