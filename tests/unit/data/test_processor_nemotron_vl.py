"""The shared data pipeline on a Nemotron-3-Nano-VL (`nemotron_h_omni`) folder against transformers'
own Nemotron-H Omni processor.

transformers' image processor for this family is a torchvision-backend class: its module imports
torchvision and calls two torchvision functions, `resize` and `normalize`. The reference runs the
real transformers code (patch budget, grid rule, fused rescale / normalise, patch layout, video
tiles, placeholder expansion with frame timestamps, tokenisation) with those two functions supplied
by a stand-in package that implements their documented semantics on float tensors:
`resize` = `torch.nn.functional.interpolate(..., align_corners=False, antialias=True)`,
`normalize` = (x - mean) / std per channel. The video processor and the processor need no
torchvision. Also: exact length planning, the labels mask, and packs of our model equal to the
per-sample forwards (images; videos with odd frame counts)."""
from __future__ import annotations

import enum
import importlib
import json
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from megatron_vlm.data.messages import Record, normalize_messages
from megatron_vlm.data.packing import collate_pack
from megatron_vlm.data.processing import estimate_length, process_record
from megatron_vlm.data.processor import load_processor

_IMAGE_MODULE = "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni"
VIDEO_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'video' %}<video>\n"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _image(path, size, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    """The tiny Nemotron-VL folder, with a chat template that also renders videos (`<video>`) and a
    small video tile (20 patches)."""
    from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_folder

    folder = build_tiny_nemotron_vl_folder(tmp_path_factory.mktemp("nem") / "tiny-nemotron-vl", seed=0)
    (folder / "chat_template.jinja").write_text(VIDEO_TEMPLATE)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", "norm_mean": pre["image_mean"],
        "norm_std": pre["image_std"], "patch_size": 16, "downsample_ratio": 0.5, "video_target_num_patches": 20}))
    return folder


@pytest.fixture(scope="module")
def proc(nemotron_dir):
    return load_processor(nemotron_dir)


@pytest.fixture
def hf_image_module(monkeypatch):
    """transformers' Nemotron-H Omni image processing module, imported over the torchvision stand-in."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils  # noqa: F401  (availability checks ran before the stand-in)

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
        x = image.reshape(-1, *image.shape[-3:])
        x = F.interpolate(x, size=list(size), mode=interpolation.value, align_corners=False, antialias=antialias)
        return x.reshape(*image.shape[:-2], *size)

    def normalize(t, mean, std, inplace=False):
        mean, std = torch.as_tensor(mean, dtype=t.dtype), torch.as_tensor(std, dtype=t.dtype)
        return (t - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    mods = [types.ModuleType(n) for n in names]
    for parent, child, n in zip(mods, mods[1:], names[1:]):
        setattr(parent, n.rsplit(".", 1)[1], child)
    tvf = mods[-1]
    tvf.InterpolationMode, tvf.resize, tvf.normalize = InterpolationMode, resize, normalize
    tvf.grayscale_to_rgb = lambda t: t  # a no-op for 3-channel images
    for n, m in zip(names, mods):
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(backends, "tvF", tvf, raising=False)
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping",
                        {2: InterpolationMode.BILINEAR, 3: InterpolationMode.BICUBIC}, raising=False)
    monkeypatch.delitem(sys.modules, _IMAGE_MODULE, raising=False)
    yield importlib.import_module(_IMAGE_MODULE)
    sys.modules.pop(_IMAGE_MODULE, None)


@pytest.fixture
def hf_proc(nemotron_dir, hf_image_module, monkeypatch):
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor,
    )
    from transformers.video_processing_utils import VideoProcessorMixin

    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    pre = json.loads((nemotron_dir / "preprocessor_config.json").read_text())
    vid = json.loads((nemotron_dir / "video_preprocessor_config.json").read_text())
    pre = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class", "do_resize")}
    # do_resize=False only silences the generic "size must be given" check; this processor always resizes.
    image_processor = hf_image_module.NemotronH_Omni_Reasoning_V3ImageProcessor(**pre, do_resize=False)
    video_processor = NemotronH_Omni_Reasoning_V3VideoProcessor(
        **{k: v for k, v in vid.items() if k != "video_processor_type"}, do_convert_rgb=False)
    return NemotronH_Omni_Reasoning_V3Processor(
        image_processor=image_processor, video_processor=video_processor,
        tokenizer=AutoTokenizer.from_pretrained(nemotron_dir), feature_extractor=FeatureExtractionMixin(),
        chat_template=(nemotron_dir / "chat_template.jinja").read_text())


def _labelled_text(proc, sample):
    return proc.tokenizer.decode(sample.input_ids[sample.label_mask])


def test_patch_grid_rule_matches_transformers(hf_image_module):
    from megatron_vlm.data.processor_nemotron_vl import patch_grid_size

    rng = np.random.default_rng(0)
    sizes = [(16, 16), (32, 48), (33, 47), (56, 56), (48, 16), (1000, 20), (20, 1000), (512, 512), (7, 9)]
    sizes += [tuple(int(x) for x in rng.integers(5, 900, 2)) for _ in range(200)]
    for h, w in sizes:
        for lo, hi in ((16, 64), (64, 64), (1024, 13312), (4, 4096)):
            assert patch_grid_size(h, w, 16, 2, lo, hi) == hf_image_module.get_patch_grid_size(h, w, 16, 2, lo, hi), (h, w, lo, hi)


@pytest.mark.parametrize("hw", [(3, 4000), (4000, 3), (3, 600), (20, 2000), (17, 2100), (1, 1)])
@pytest.mark.parametrize("budget", [64, 1024])
def test_too_thin_image_is_a_bad_record_where_transformers_divides_by_zero(hf_image_module, hw, budget):
    """A side that scales to 0 patches: transformers' rule raises ZeroDivisionError, ours the bad record
    "unsupported_shape" (was counted as "unexpected_error" with a traceback); sizes agree otherwise."""
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.processor_nemotron_vl import patch_grid_size

    args = (*hw, 16, 2, 16, budget)
    try:
        expected = hf_image_module.get_patch_grid_size(*args)
    except ZeroDivisionError:
        with pytest.raises(BadRecordError, match="scales to 0 patches") as got:
            patch_grid_size(*args)
        assert got.value.category == "unsupported_shape"
    else:
        assert patch_grid_size(*args) == expected


def test_images_match_transformers_processor(proc, hf_proc, tmp_path):
    from megatron_vlm.data.processor_nemotron_vl import NemotronVLProcessor

    assert isinstance(proc, NemotronVLProcessor) and proc.video_token_id is None
    paths = [_image(tmp_path / "a.png", (90, 56), 1), _image(tmp_path / "b.png", (40, 200), 2),
             _image(tmp_path / "c.png", (64, 64), 3)]  # c: already on its patch grid, no resize
    raw = [
        {"role": "user", "content": [{"type": "image", "image": paths[0]}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image", "image": paths[1]},
                                     {"type": "image", "image": paths[2]}]},
        {"role": "assistant", "content": "a blue square"},
    ]
    rec = Record(normalize_messages(raw), "mem", 1)
    ours = process_record(rec, proc, max_frames=4)
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    ref = hf_proc(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert ours.image_grid_thw[:, 0].tolist() == [1, 1, 1]
    assert torch.equal(ours.image_grid_thw[:, 1:], ref["image_grid_hw"])
    assert ours.pixel_values.shape == ref["pixel_values"].shape and ours.pixel_values.shape[1] == 3 * 16 * 16
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"], rtol=0, atol=1e-5)
    assert estimate_length(rec, proc, max_frames=4) == len(ours)
    assert _labelled_text(proc, ours) == "red<|im_end|>a blue square<|im_end|>"


def test_video_matches_transformers_processor(proc, hf_proc, tmp_path):
    from transformers.video_utils import VideoMetadata

    frames = [_image(tmp_path / f"f{i}.png", (72, 40), 10 + i) for i in range(9)]
    raw = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 3.0},
                                        {"type": "text", "text": "What happens?"}]},
           {"role": "assistant", "content": "it moves"}]
    rec = Record(normalize_messages(raw), "mem", 1)
    ours = process_record(rec, proc, max_frames=5)  # 9 frames -> 0, 2, 4, 6, 8
    kept = [0, 2, 4, 6, 8]
    text = hf_proc.apply_chat_template(raw, tokenize=False)
    ref = hf_proc(text=[text], videos=[[Image.open(frames[i]).convert("RGB") for i in kept]], return_tensors="pt",
                  videos_kwargs={"video_metadata": VideoMetadata(total_num_frames=9, fps=3.0, frames_indices=kept)})
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert "Frame 5 sampled at 2.66 seconds: <img>" in proc.tokenizer.decode(ours.input_ids)
    # one padding frame (the last one repeated) completes the third tubelet
    assert ours.pixel_values_videos.shape[0] == 6
    want = ref["pixel_values_videos"]
    if want.dim() == 5:  # transformers >= 5.24: [videos, tubelets, 2 x 3 channels, H, W], the padding frame included
        want = want.reshape(-1, 3, *want.shape[-2:])
        assert want.shape[0] == 6
    else:  # earlier: the 5 sampled frames, [frames, 3, H, W]
        want = torch.cat([want, want[-1:]])
    torch.testing.assert_close(ours.pixel_values_videos, want, rtol=0, atol=1e-5)
    assert torch.equal(ours.pixel_values_videos[5], ours.pixel_values_videos[4])
    assert estimate_length(rec, proc, max_frames=5, fps=2.0) == len(ours)
    assert _labelled_text(proc, ours) == "it moves<|im_end|>"


def test_packs_give_the_per_sample_logits(proc, nemotron_dir, tmp_path):
    from megatron_vlm.checkpoint import load_hf_model

    def video(name, n):
        return [_image(tmp_path / f"{name}{i}.png", (64, 48), {"u": 30, "v": 40}[name] + i) for i in range(n)]

    image_records = [
        [{"role": "user", "content": [{"type": "image", "image": _image(tmp_path / "p.png", (100, 56), 7)},
                                      {"type": "text", "text": "shape?"}]}, {"role": "assistant", "content": "circle"}],
        [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": [{"type": "image", "image": _image(tmp_path / "q.png", (30, 70), 8)},
                                      {"type": "text", "text": "count?"}]}, {"role": "assistant", "content": "two"}],
    ]
    video_records = [  # odd frame counts: tubelets must not straddle the two videos of the pack
        [{"role": "user", "content": [{"type": "video", "video": video(name, n)}, {"type": "text", "text": "what?"}]},
         {"role": "assistant", "content": "a cup"}] for name, n in (("u", 3), ("v", 1))
    ]
    model = load_hf_model(nemotron_dir).eval()
    for records in (image_records, video_records):
        samples = [process_record(Record(normalize_messages(r), "mem", i), proc, max_frames=4)
                   for i, r in enumerate(records)]
        pack = collate_pack(samples)
        assert pack["cu_seqlens"].tolist() == [0, *np.cumsum([len(s) for s in samples]).tolist()]
        keys = ("pixel_values", "image_grid_thw", "pixel_values_videos")
        with torch.no_grad():
            packed = model(pack["input_ids"], cu_seqlens=pack["cu_seqlens"], **{k: pack[k] for k in keys if k in pack})[0]
            single = torch.cat([model(s.input_ids[None], **{k: getattr(s, k) for k in keys
                                                            if getattr(s, k) is not None})[0] for s in samples])
        torch.testing.assert_close(packed, single, rtol=1e-4, atol=1e-4)


def test_loader_plans_exact_lengths_for_timestamped_videos(proc, tmp_path):
    """Frame timestamps depend on [data] fps; planned (estimated) and processed lengths must agree, or
    the loader would drop samples as length_mismatch. Videos whose frames get another tile size than
    the others (another aspect ratio) cannot share their frame tensor: they are planned into a pack of
    their own tile size (the length pass's pack classes), where they were dropped as bad records before."""
    from megatron_vlm.data.config import DataConfig
    from megatron_vlm.data.loader import build_sft_dataloader

    lines = []
    for i in range(7):
        width = 128 if i == 6 else 64  # record 7 (1-based line): 2:1 frames -> another tile than 4:3
        frames = [_image(tmp_path / f"r{i}_{j}.png", (width, 48), 100 * i + j) for j in range(2 + i % 4)]
        content = [{"type": "video", "video": [f.rsplit("/", 1)[1] for f in frames]}, {"type": "text", "text": f"clip {i}"}]
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": f"answer {i}"}]}))
    (tmp_path / "v.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "v.jsonl"), max_tokens_per_pack=2000,
                     num_workers=0, max_frames=5, fps=7.0, shuffle=False)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert loader.packs_per_epoch == 2  # the 4:3 clips, then the 2:1 one (all 7 fit one pack by tokens)
    it = iter(loader)
    pack, wide = next(it), next(it)
    assert loader.bad_records.entries == []  # was: record 7 dropped as a "video" bad record
    assert int(pack["num_samples"]) == 6 and pack["pixel_values_videos"].shape[1:] == (3, 64, 64)
    assert int(wide["num_samples"]) == 1 and wide["pixel_values_videos"].shape[1:] != (3, 64, 64)
    seen = [b - a for a, b in zip(pack["cu_seqlens"][:-1].tolist(), pack["cu_seqlens"][1:].tolist())]
    assert seen == [int(n) for n in loader.planner.lengths[:6]]
    assert wide["cu_seqlens"].tolist() == [0, int(loader.planner.lengths[6])]
    assert "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.14 seconds: <img>" in \
        proc.tokenizer.decode(pack["input_ids"][0])
