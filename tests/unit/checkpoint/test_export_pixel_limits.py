"""A run that overrides the pixel limits (`data.max_pixels` / `data.min_pixels`, `data.video_*`) exports them: the
exported folder's preprocessor configs hold the limits it trained with, so transformers' processor (and vLLM,
which reads the same files) cuts an image into as many tokens as training did. The export carried the source
folder's limits before. Reference: transformers' Qwen2-VL image processor loaded from the
export, and for videos transformers' own choice of the file it builds the video processor from (the processor itself
needs torchvision: where it is installed, `AutoVideoProcessor` sizes a video as the run's processor does)."""
from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
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


def _export(tmp_path, data, src=None):
    src = src or synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "src", seed=1)
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


def _video_dict(folder):
    """The dict transformers builds the folder's video processor from (its own file resolution: processor_config.json's
    nested "video_processor", else video_preprocessor_config.json, else preprocessor_config.json)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    return BaseVideoProcessor.get_video_processor_dict(str(folder), local_files_only=True)[0]


def _dict_pixels(d):
    """(smallest, largest) area a Qwen2-VL video processor takes from its dict: top-level min / max_pixels override
    `size` (transformers' `Qwen2VLVideoProcessor.__init__`)."""
    size = d.get("size") or {}
    return d.get("min_pixels", size.get("shortest_edge")), d.get("max_pixels", size.get("longest_edge"))


def _old_folder(tmp_path):
    """A Qwen2.5-VL folder from before video processor configs: transformers builds its video processor from
    preprocessor_config.json."""
    src = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "src", seed=1)
    (src / "video_preprocessor_config.json").unlink()
    return src


def _export_reward(src, out, limits):
    from megatron_vlm.training.reward.export import export_score_folder
    from megatron_vlm.training.reward.model import ScoreRoot

    root = ScoreRoot(load_hf_model(src), std=0.0, seed=0)
    export_score_folder(root.state_dict(), root.model, out, copy_from=src, pixel_limits=limits)


@pytest.mark.parametrize("kind", ["policy", "reward"])
def test_a_folder_without_a_video_config_exports_the_video_limits(tmp_path, kind):
    """An older Qwen2.5-VL folder has no video_preprocessor_config.json: transformers (and vLLM) then build the video
    processor from preprocessor_config.json, the image one. The export wrote the run's image limits there and its
    video limits nowhere, so videos were sized by the image limits, not as training sized them. The export now has
    a video config with the video limits; transformers' own file resolution reads them."""
    src = _old_folder(tmp_path)
    assert _dict_pixels(_video_dict(src)) == (3136, 12544)  # transformers' fallback: the image config
    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4,
              "video_min_pixels": 28 * 28 * 2, "video_max_pixels": TINY_VIDEO_MAX_PIXELS * 2}
    if kind == "policy":
        _, out = _export(tmp_path, NS(**limits), src=src)
    else:
        _export_reward(src, tmp_path / "rm", limits)
        out = tmp_path / "rm"
    trained = load_processor(src, **limits)  # what the run's data pipeline used
    assert _dict_pixels(_video_dict(out)) == (trained.video_min_pixels, trained.video_max_pixels) == (
        28 * 28 * 2, TINY_VIDEO_MAX_PIXELS * 2)
    assert _video_dict(out).get("image_processor_type") == "Qwen2VLImageProcessor"  # the class inferred as before
    assert load_processor(out).identity() == trained.identity()


def test_image_limits_alone_leave_such_a_folders_videos_as_trained(tmp_path):
    """Only the image limits set: training sized videos by the folder's own (image) config; the export's new image
    limits must not become the videos' limits in transformers."""
    src = _old_folder(tmp_path)
    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4, "video_min_pixels": None,
              "video_max_pixels": None}
    _, out = _export(tmp_path, NS(**limits), src=src)
    trained = load_processor(src, **limits)
    assert _dict_pixels(_video_dict(out)) == (trained.video_min_pixels, trained.video_max_pixels) == (3136, 12544)
    assert load_processor(out).identity() == trained.identity()


def test_limits_go_into_the_nested_processor_config_transformers_reads_first(tmp_path):
    """A folder saved by transformers 5 may nest the processors' dicts in processor_config.json, which transformers
    reads before preprocessor_config.json / video_preprocessor_config.json: the limits go there too."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    src = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "src", seed=1)
    nested = json.loads((src / "processor_config.json").read_text())
    nested["image_processor"] = json.loads((src / "preprocessor_config.json").read_text())
    nested["video_processor"] = json.loads((src / "video_preprocessor_config.json").read_text())
    (src / "processor_config.json").write_text(json.dumps(nested))
    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4,
              "video_min_pixels": 28 * 28 * 2, "video_max_pixels": TINY_VIDEO_MAX_PIXELS * 2}
    _, out = _export(tmp_path, NS(**limits), src=src)
    trained = load_processor(src, **limits)
    assert _dict_pixels(_video_dict(out)) == (28 * 28 * 2, TINY_VIDEO_MAX_PIXELS * 2)
    image = Image.new("RGB", (224, 168), (90, 30, 200))
    n_theirs = int(Qwen2VLImageProcessorPil.from_pretrained(out)(images=[image])["image_grid_thw"].prod()) // 4
    assert n_theirs == trained.num_tokens(trained.image_grid_thw(image.height, image.width))


def test_transformers_sizes_the_exported_videos_as_training_did(tmp_path):
    """With torchvision (transformers' Qwen2-VL video processor needs it): `AutoVideoProcessor` loaded from the
    export of a folder without a video config gives each video frame as many patches as the run's processor."""
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    src = _old_folder(tmp_path)
    limits = {"min_pixels": 28 * 28, "max_pixels": TINY_IMAGE_MAX_PIXELS * 4,
              "video_min_pixels": 28 * 28 * 2, "video_max_pixels": TINY_VIDEO_MAX_PIXELS * 2}
    _, out = _export(tmp_path, NS(**limits), src=src)
    trained = load_processor(src, **limits)
    video = torch.randint(0, 255, (4, 3, 252, 336), dtype=torch.uint8)
    theirs = AutoVideoProcessor.from_pretrained(out)(videos=[video], return_tensors="pt")["video_grid_thw"][0]
    assert tuple(int(x) for x in theirs) == tuple(trained.video_grid_thw(4, 252, 336))
