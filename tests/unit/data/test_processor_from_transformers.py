"""A transformers Qwen-VL processor object handed to the data pipeline (`as_vl_processor`, what `build_sft_dataloader`
accepts beside a model folder) keeps its video processor's settings.

Reference: transformers' `Qwen3VLProcessor` with its own `Qwen3VLVideoProcessor` (`get_num_of_video_patches`, the
processor's normalisation settings). The conversion used to read the image processor only: a video processor's
per-frame cap (`cap_pixels_per_frame`, `max_video_tokens`) and its own mean / std were dropped, so videos got other
token counts and pixels than the processor given; a non-Qwen processor (InternVL) failed with an AttributeError.
"""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.processor import as_vl_processor


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_processor

    return build_tiny_qwen3_vl_processor(tmp_path_factory.mktemp("q3p") / "tiny-qwen3-vl")


@pytest.fixture
def hf_proc(qwen3_dir, monkeypatch):
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    vid = json.loads((qwen3_dir / "video_preprocessor_config.json").read_text())
    vid = {k: v for k, v in vid.items() if k not in ("video_processor_type", "processor_class")}
    vid.update(cap_pixels_per_frame=True, max_video_tokens=2, image_mean=[0.4, 0.3, 0.2], image_std=[0.2, 0.3, 0.4])
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(qwen3_dir),
                            tokenizer=AutoTokenizer.from_pretrained(qwen3_dir), video_processor=Qwen3VLVideoProcessor(**vid),
                            chat_template=(qwen3_dir / "chat_template.jinja").read_text())


def test_video_settings_of_a_transformers_processor_are_kept(hf_proc):
    proc = as_vl_processor(hf_proc)
    vp = hf_proc.video_processor
    assert proc.video_timestamps and proc.cap_pixels_per_frame and proc.max_video_tokens == 2
    for n, h, w in ((4, 200, 300), (8, 64, 64), (3, 40, 500)):
        t, gh, gw = proc.video_grid_thw(n, h, w)
        assert t * gh * gw == vp.get_num_of_video_patches(n, h, w, {"size": dict(vp.size), "cap_pixels_per_frame": True})
    assert list(proc.video_norm["image_mean"]) == [0.4, 0.3, 0.2] and list(proc.video_norm["image_std"]) == [0.2, 0.3, 0.4]
    assert list(proc.image_processor.image_mean) == [0.5, 0.5, 0.5]  # the image processor keeps its own


def test_a_processor_of_another_family_is_refused_by_name(tmp_path):
    from transformers import AutoTokenizer
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_processor

    folder = build_tiny_internvl_processor(tmp_path / "iv")

    class InternVLProcessor:  # what the pipeline reads of transformers' InternVLProcessor
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = GotOcr2ImageProcessorPil.from_pretrained(folder)

    with pytest.raises(TypeError, match="InternVLProcessor.*model folder"):
        as_vl_processor(InternVLProcessor())
