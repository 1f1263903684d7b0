"""A run that overrides the pixel limits (`data.max_pixels` / `data.min_pixels`, `data.video_*`) exports them: the
exported folder's preprocessor configs hold the limits it trained with, so transformers' processor (and vLLM,
which reads the same files) cuts an image into as many tokens as training did. The export carried the source
folder's limits before. Reference: transformers' Qwen2-VL image processor loaded from the
export (its video processor needs torchvision: the video limits are checked in the file it reads)."""
from __future__ import annotations

import json
from types import SimpleNamespace as NS

import torch
from PIL import Image

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.testing.tiny_processor import TINY_IMAGE_MAX_PIXELS, TINY_VIDEO_MAX_PIXELS
from megatron_vlm.training.checkpointing import Checkpointer


class _Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


def _export(tmp_path, data):
    src = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "src", seed=1)
    cfg = NS(checkpoint=NS(enable=False, every_steps=0, keep_last=0, resume=None, export_hf=True, export_dtype=None),
             model=NS(path=str(src)), data=data)
    ctx = NS(cfg=cfg, env=NS(is_main=True, rank=0), run_dir=tmp_path / "run")
    ck = Checkpointer(ctx, _Wrapper(load_hf_model(src)), NS(optimizer=None, scheduler=None))
    ck.export_hf(tmp_path / "run" / "hf")
    return src, tmp_path / "run" / "hf"


def test_the_export_holds_the_pixel_limits_the_run_trained_with(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4,
              "video_min_pixels": 28 * 28, "video_max_pixels": TINY_VIDEO_MAX_PIXELS * 2}
    src, out = _export(tmp_path, NS(**limits))
    trained = load_processor(src, **limits)  # what the run's data pipeline used
    image = Image.new("RGB", (224, 168), (90, 30, 200))
    ours = trained.num_tokens(trained.image_grid_thw(image.height, image.width))
    n_theirs = int(Qwen2VLImageProcessorPil.from_pretrained(out)(images=[image])["image_grid_thw"].prod()) // 4
    assert n_theirs == ours > TINY_IMAGE_MAX_PIXELS // (28 * 28)  # more than the source folder allows
    vid = json.loads((out / "video_preprocessor_config.json").read_text())
    assert (vid["size"]["shortest_edge"], vid["size"]["longest_edge"]) == (28 * 28, TINY_VIDEO_MAX_PIXELS * 2)
    assert load_processor(out).identity() == trained.identity()  # a later stage starting from the export agrees


def test_without_overrides_the_source_limits_are_kept(tmp_path):
    src, out = _export(tmp_path, NS(min_pixels=None, max_pixels=None, video_min_pixels=None, video_max_pixels=None))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((src / name).read_text())


def test_a_reward_model_export_holds_the_pixel_limits_too(tmp_path):
    """The reward-model folder (training/reward/export.py, written at the end of a reward run and by
    convert_checkpoint) sizes images as the run did, as the policy export does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megatron_vlm.training.reward.export import export_score_folder
    from megatron_vlm.training.reward.model import ScoreRoot

    src = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "src", seed=1)
    root = ScoreRoot(load_hf_model(src), std=0.0, seed=0)
    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4, "video_min_pixels": None,
              "video_max_pixels": None}
    export_score_folder(root.state_dict(), root.model, tmp_path / "rm", copy_from=src, pixel_limits=limits)
    trained = load_processor(src, min_pixels=limits["min_pixels"], max_pixels=limits["max_pixels"])
    image = Image.new("RGB", (224, 168), (90, 30, 200))
    ours = trained.num_tokens(trained.image_grid_thw(image.height, image.width))
    n_theirs = int(Qwen2VLImageProcessorPil.from_pretrained(tmp_path / "rm")(images=[image])["image_grid_thw"].prod()) // 4
    assert n_theirs == ours > TINY_IMAGE_MAX_PIXELS // (28 * 28)
