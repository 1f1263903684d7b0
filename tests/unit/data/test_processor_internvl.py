"""The shared data pipeline on an InternVL folder against transformers' own `InternVLProcessor`.

Reference: transformers' InternVLProcessor over the folder's tokenizer, chat template and
`GotOcr2ImageProcessorPil` (dynamic tiling + thumbnail). Its video processor
(`InternVLVideoProcessor`) needs torchvision only to resize frames; the reference gets a video
processor that does that one step with transformers' PIL image processor (resize to the tile size,
normalise) and leaves the rest — `<video>` -> "Frame1: <img>...</img>\\n...", merging video frames
into `pixel_values` in placeholder order, tokenisation — to transformers.
Also: exact length planning, the labels mask, packs (cu_seqlens, tiles per sample) and a packed
forward of our InternVL model equal to the per-sample forwards."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.packing import collate_pack
from megatron_vlm.data.processing import estimate_length, process_record
from megatron_vlm.data.processor import load_processor


def _image(path, size, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_folder

    return build_tiny_internvl_folder(tmp_path_factory.mktemp("iv") / "tiny-internvl", seed=0)


@pytest.fixture(scope="module")
def proc(internvl_dir):
    return load_processor(internvl_dir)


@pytest.fixture
def hf_proc(internvl_dir, monkeypatch):
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, BatchFeature
    from transformers import InternVLProcessor as HFInternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.video_processing_utils import VideoProcessorMixin

    from megatron_vlm.testing.tiny_processor_internvl import TOKENS_PER_TILE

    image_processor = GotOcr2ImageProcessorPil.from_pretrained(internvl_dir)

    class FramesResizedWithPil(VideoProcessorMixin):
        """InternVLVideoProcessor's output layout [videos, frames, 3, H, W]; resize by PIL, not torchvision."""

        def __call__(self, videos, **kwargs):
            out = [image_processor(images=list(v), crop_to_patches=False, return_tensors="pt")["pixel_values"]
                   for v in videos]
            return BatchFeature({"pixel_values_videos": torch.stack(out)})

    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    return HFInternVLProcessor(
        image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(internvl_dir),
        video_processor=FramesResizedWithPil(), image_seq_length=TOKENS_PER_TILE,
        chat_template=(internvl_dir / "chat_template.jinja").read_text())


def _check_label_mask(proc, sample, raw):
    ids, mask = sample.input_ids.tolist(), sample.label_mask.tolist()
    runs, t = [], 0
    while t < len(mask):
        if mask[t]:
            s = t
            while t < len(mask) and mask[t]:
                t += 1
            runs.append((s, t))
        t += 1
    answers = [m["content"] for m in raw if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for (s, e), ans in zip(runs, answers):
        assert ids[s:e] == proc.tokenizer(ans, add_special_tokens=False)["input_ids"] + [im_end]


def test_folder_is_recognised_with_transformers_token_names(proc):
    from megatron_vlm.data.processor_internvl import InternVLProcessor
    from megatron_vlm.testing.tiny_processor_internvl import TINY_MAX_TILES, TOKENS_PER_TILE

    assert isinstance(proc, InternVLProcessor)
    assert (proc.image_token, proc.video_token, proc.start_image_token, proc.end_image_token) == (
        "<IMG_CONTEXT>", "<video>", "<img>", "</img>")
    assert proc.image_seq_length == TOKENS_PER_TILE and proc.image_processor.max_patches == TINY_MAX_TILES
    assert proc.image_token_id == proc.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") and proc.video_token_id is None
    with pytest.raises(ValueError, match="pixel limits do not apply"):
        proc.with_overrides(max_pixels=1000)


def test_images_match_transformers_processor(proc, hf_proc, tmp_path):
    # wide 2:1 -> 2 tiles + thumbnail, square -> 1 tile, tall 1:3 -> 3 tiles + thumbnail, 4:1 -> 4 + thumbnail
    paths = [_image(tmp_path / "wide.png", (112, 56), 1), _image(tmp_path / "sq.png", (50, 50), 2),
             _image(tmp_path / "tall.png", (40, 130), 3), _image(tmp_path / "strip.png", (230, 60), 4)]
    raw = [
        {"role": "user", "content": [{"type": "image", "image": paths[0]}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image", "image": paths[1]},
                                     {"type": "image", "image": paths[2]}, {"type": "image", "image": paths[3]}]},
        {"role": "assistant", "content": "a blue square"},
    ]
    rec = Record(normalize_messages(raw), "mem", 1)
    ours = process_record(rec, proc, max_frames=4)
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    ref = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert ours.pixel_values.shape == (3 + 1 + 4 + 5, 3, 56, 56)
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert ours.image_grid_thw is None and ours.pixel_values_videos is None
    assert estimate_length(rec, proc, max_frames=4) == len(ours)
    _check_label_mask(proc, ours, raw)


def test_video_between_images_matches_transformers_processor(proc, hf_proc, tmp_path):
    frames = [_image(tmp_path / f"f{i}.png", (80, 60), 10 + i) for i in range(7)]
    img_a, img_b = _image(tmp_path / "a.png", (112, 56), 5), _image(tmp_path / "b.png", (56, 56), 6)
    raw = [
        {"role": "user", "content": [{"type": "image", "image": img_a}, {"type": "video", "video": frames},
                                     {"type": "text", "text": "What happens after this?"},
                                     {"type": "image", "image": img_b}]},
        {"role": "assistant", "content": "the robot picks up the cup"},
    ]
    rec = Record(normalize_messages(raw), "mem", 1)
    ours = process_record(rec, proc, max_frames=4)  # 7 frames -> 0, 2, 4, 6
    kept = [Image.open(frames[i]).convert("RGB") for i in (0, 2, 4, 6)]
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    assert text.count("<video>") == 1
    ref = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in (img_a, img_b)], videos=[kept],
                  return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert ours.pixel_values.shape[0] == 3 + 4 + 1  # image tiles, frames, image tile: placeholder order
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    decoded = proc.tokenizer.decode(ours.input_ids)
    assert "Frame1: <img>" in decoded and "</img>\nFrame4: <img>" in decoded
    assert estimate_length(rec, proc, max_frames=4) == len(ours)
    _check_label_mask(proc, ours, raw)


def test_lookalike_call_matches_transformers_processor(proc, hf_proc, tmp_path):
    imgs = [Image.open(_image(tmp_path / f"c{i}.png", size, i)).convert("RGB")
            for i, size in enumerate([(120, 56), (56, 56)])]
    texts = ["<|im_start|>user\n<IMG_CONTEXT>\nhi<|im_end|>\n",
             "<|im_start|>user\n<IMG_CONTEXT>\nhello there<|im_end|>\n<|im_start|>assistant\n"]
    ours = proc(text=texts, images=imgs, padding=True, padding_side="left")
    ref = hf_proc(text=texts, images=imgs, padding=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], ref["input_ids"]) and torch.equal(ours["attention_mask"], ref["attention_mask"])
    torch.testing.assert_close(ours["pixel_values"], ref["pixel_values"].float(), rtol=0, atol=0)


def test_packed_samples_give_the_per_sample_logits(proc, internvl_dir, tmp_path):
    from megatron_vlm.checkpoint import load_hf_model

    frames = [_image(tmp_path / f"v{i}.png", (64, 48), 20 + i) for i in range(3)]
    records = [
        [{"role": "user", "content": [{"type": "image", "image": _image(tmp_path / "p.png", (100, 56), 7)},
                                      {"type": "text", "text": "shape?"}]}, {"role": "assistant", "content": "circle"}],
        [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "count?"}]},
         {"role": "assistant", "content": "two"}],
    ]
    samples = [process_record(Record(normalize_messages(r), "mem", i), proc, max_frames=4) for i, r in enumerate(records)]
    pack = collate_pack(samples)
    assert pack["cu_seqlens"].tolist() == [0, *np.cumsum([len(s) for s in samples]).tolist()]
    assert pack["pixel_values"].shape[0] == samples[0].pixel_values.shape[0] + 3 == 3 + 3
    model = load_hf_model(internvl_dir).eval()
    with torch.no_grad():
        packed = model(pack["input_ids"], pixel_values=pack["pixel_values"], cu_seqlens=pack["cu_seqlens"])[0]
        single = torch.cat([model(s.input_ids[None], pixel_values=s.pixel_values)[0] for s in samples])
    torch.testing.assert_close(packed, single, rtol=1e-4, atol=1e-4)
