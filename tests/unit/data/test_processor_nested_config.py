"""Model folders whose processor was saved by transformers 5: one processor_config.json holding the image / video
processors' settings as nested "image_processor" / "video_processor" dicts, which transformers reads before
preprocessor_config.json / video_preprocessor_config.json. Such a folder did not load with us (preprocessor_config.json
was required), and a folder holding both forms, with other limits in each, was sized by the flat files while
transformers (and vLLM) size by the nested dicts.

References: transformers' `AutoImageProcessor` loaded from the folder (its own file resolution, its own resize) for
the image token counts, and transformers' `get_image_processor_dict` / `get_video_processor_dict` (the dict it builds
each processor from) where its processor needs torchvision (Nemotron-VL images, every video processor). With
torchvision installed, `AutoProcessor` itself counts the image tokens of a prompt."""
from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from megatron_vlm.data.processor import load_processor

IMAGE = Image.new("RGB", (224, 168), (90, 30, 200))


def _read(path):
    return json.loads(path.read_text())


def _write(path, data):
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _area_limits(cfg: dict, lo: int, hi: int) -> dict:
    """`cfg` with smallest / largest area `lo` / `hi`, in both of transformers' spellings where the config has them."""
    cfg = dict(cfg, size={"shortest_edge": lo, "longest_edge": hi})
    for key, value in (("min_pixels", lo), ("max_pixels", hi)):
        if key in cfg:
            cfg[key] = value
    return cfg


def _nest(folder, *, image: dict, video: dict | None, keep_flat: bool) -> None:
    """Rewrite `folder` in transformers 5's form: the sub-processor settings `image` / `video` nested in
    processor_config.json; with `keep_flat` the flat files stay as they were (other settings than the nested ones)."""
    proc_path = folder / "processor_config.json"
    proc = _read(proc_path) if proc_path.is_file() else {}
    proc["image_processor"] = image
    if video is not None:
        proc["video_processor"] = video
    _write(proc_path, proc)
    if not keep_flat:
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            (folder / name).unlink(missing_ok=True)


def _their_dicts(folder):
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    return (ImageProcessingMixin.get_image_processor_dict(str(folder), local_files_only=True)[0],
            BaseVideoProcessor.get_video_processor_dict(str(folder), local_files_only=True)[0])


def _video_area(d: dict) -> tuple[int, int]:
    """(smallest, largest) area of a Qwen-VL video processor's dict (top-level min / max_pixels override `size`)."""
    size = d.get("size") or {}
    return d.get("min_pixels", size.get("shortest_edge")), d.get("max_pixels", size.get("longest_edge"))


def _their_qwen_image_tokens(folder) -> int:
    from transformers import AutoImageProcessor

    grid = AutoImageProcessor.from_pretrained(folder)(images=[IMAGE])["image_grid_thw"]
    return int(grid.prod()) // 4


def _our_qwen_image_tokens(proc) -> int:
    return proc.num_tokens(proc.image_grid_thw(IMAGE.height, IMAGE.width))


@pytest.mark.parametrize("keep_flat", [False, True], ids=["nested_only", "stale_flat_files"])
def test_qwen2_5_vl_folder_saved_by_transformers(tmp_path, tiny_dir, keep_flat, monkeypatch):
    """transformers' own `save_pretrained` writes the nested form (no preprocessor_config.json); the saved image
    processor has limits other than the flat files'."""
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

    lo, hi, vlo, vhi = 28 * 28, 28 * 28 * 64, 28 * 28, 28 * 28 * 8
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir, size={"shortest_edge": lo, "longest_edge": hi})
    # Without torchvision the processor class is only built with its base video processor (conftest.hf_processor).
    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    saved = tmp_path / "saved"
    Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(tiny_dir),
                        video_processor=BaseVideoProcessor(),
                        chat_template=(tiny_dir / "chat_template.jinja").read_text()).save_pretrained(saved)
    assert not (saved / "preprocessor_config.json").exists()  # transformers 5 writes the nested form
    proc_cfg = _read(saved / "processor_config.json")
    assert proc_cfg["image_processor"]["size"] == {"shortest_edge": lo, "longest_edge": hi}
    # The video processor's settings as the family's video processor writes them (it needs torchvision to build).
    proc_cfg["video_processor"] = _area_limits(_read(tiny_dir / "video_preprocessor_config.json"), vlo, vhi)
    _write(saved / "processor_config.json", proc_cfg)
    if keep_flat:
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            shutil.copy(tiny_dir / name, saved / name)

    ours = load_processor(saved)
    image_dict, video_dict = _their_dicts(saved)
    assert (ours.image_min_pixels, ours.image_max_pixels) == (lo, hi)
    assert (ours.video_min_pixels, ours.video_max_pixels) == _video_area(video_dict) == (vlo, vhi)
    assert _our_qwen_image_tokens(ours) == _their_qwen_image_tokens(saved) > 16  # 16: the flat files' cap
    assert image_dict["size"]["longest_edge"] == hi


@pytest.mark.parametrize("keep_flat", [False, True], ids=["nested_only", "stale_flat_files"])
def test_qwen3_vl_nested_form(tmp_path, keep_flat):
    from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_processor

    folder = build_tiny_qwen3_vl_processor(tmp_path / "q3")
    lo, hi, vlo, vhi = 32 * 32, 32 * 32 * 32, 32 * 32 * 2, 32 * 32 * 12
    _nest(folder, image=_area_limits(_read(folder / "preprocessor_config.json"), lo, hi),
          video=_area_limits(_read(folder / "video_preprocessor_config.json"), vlo, vhi), keep_flat=keep_flat)
    ours = load_processor(folder)
    _, video_dict = _their_dicts(folder)
    assert ours.video_timestamps  # still recognised as Qwen3-VL
    assert (ours.image_min_pixels, ours.image_max_pixels) == (lo, hi)
    assert (ours.video_min_pixels, ours.video_max_pixels) == _video_area(video_dict) == (vlo, vhi)
    assert _our_qwen_image_tokens(ours) == _their_qwen_image_tokens(folder) > 16  # 16: the flat files' cap


@pytest.mark.parametrize("keep_flat", [False, True], ids=["nested_only", "stale_flat_files"])
def test_internvl_nested_form(tmp_path, keep_flat):
    from transformers import AutoImageProcessor

    from megatron_vlm.testing.tiny_processor_internvl import TINY_MAX_TILES, build_tiny_internvl_processor

    folder = build_tiny_internvl_processor(tmp_path / "ivl")
    image = dict(_read(folder / "preprocessor_config.json"), max_patches=TINY_MAX_TILES * 3)
    video = dict(_read(folder / "video_preprocessor_config.json"), size={"height": 28, "width": 28})
    _nest(folder, image=image, video=video, keep_flat=keep_flat)
    ours = load_processor(folder)
    theirs = AutoImageProcessor.from_pretrained(folder)(images=[IMAGE])["num_patches"][0]
    assert ours.num_tiles(IMAGE.height, IMAGE.width) == theirs > TINY_MAX_TILES + 1  # more than the flat files allow
    assert dict(ours.video_processor.size) == _their_dicts(folder)[1]["size"] == {"height": 28, "width": 28}


@pytest.mark.parametrize("keep_flat", [False, True], ids=["nested_only", "stale_flat_files"])
def test_nemotron_vl_nested_form(tmp_path, keep_flat):
    """Nemotron-VL's image processor needs torchvision: the reference is the dict transformers builds it from."""
    from megatron_vlm.testing.tiny_nemotron_vl import TINY_MAX_NUM_PATCHES, TINY_MIN_NUM_PATCHES, build_tiny_nemotron_vl_folder

    folder = build_tiny_nemotron_vl_folder(tmp_path / "nem")
    flat = _read(folder / "preprocessor_config.json")
    image = dict(flat, min_num_patches=TINY_MIN_NUM_PATCHES * 2, max_num_patches=TINY_MAX_NUM_PATCHES * 2)
    video = {"video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", "norm_mean": flat["image_mean"],
             "norm_std": flat["image_std"], "patch_size": 16, "downsample_ratio": 0.5, "video_target_num_patches": 24}
    _nest(folder, image=image, video=video, keep_flat=keep_flat)
    ours = load_processor(folder)
    image_dict, video_dict = _their_dicts(folder)
    assert (ours.min_num_patches, ours.max_num_patches) == (image_dict["min_num_patches"],
                                                            image_dict["max_num_patches"]) == (32, 128)
    assert ours.video_target_num_patches == video_dict["video_target_num_patches"] == 24


def test_a_video_config_falls_back_as_transformers_does(tmp_path, tiny_dir):
    """Nested image settings and no video settings anywhere but preprocessor_config.json: transformers builds the
    video processor from that file (not from the nested image dict); so do we."""
    folder = tmp_path / "f"
    shutil.copytree(tiny_dir, folder)
    (folder / "video_preprocessor_config.json").unlink()
    flat = _read(folder / "preprocessor_config.json")
    _nest(folder, image=_area_limits(flat, 28 * 28, 28 * 28 * 64), video=None, keep_flat=True)
    ours = load_processor(folder)
    assert (ours.video_min_pixels, ours.video_max_pixels) == _video_area(_their_dicts(folder)[1]) == \
        (flat["size"]["shortest_edge"], flat["size"]["longest_edge"])
    assert (ours.image_min_pixels, ours.image_max_pixels) == (28 * 28, 28 * 28 * 64)


def test_a_nested_entry_that_is_not_an_object_is_refused(tmp_path, tiny_dir):
    folder = tmp_path / "f"
    shutil.copytree(tiny_dir, folder)
    _write(folder / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor", "image_processor": "x"})
    with pytest.raises(ValueError, match=r'processor_config.json: "image_processor" must be a JSON object'):
        load_processor(folder)


def test_autoprocessor_counts_the_same_image_tokens(tmp_path, tiny_dir):
    """With torchvision, transformers' whole processor built from a nested-form folder expands the image placeholder
    into as many tokens as ours."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    folder = tmp_path / "f"
    shutil.copytree(tiny_dir, folder)
    _nest(folder, image=_area_limits(_read(folder / "preprocessor_config.json"), 28 * 28, 28 * 28 * 64),
          video=_read(folder / "video_preprocessor_config.json"), keep_flat=True)
    theirs = AutoProcessor.from_pretrained(folder)
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = theirs(text=[text], images=[IMAGE], return_tensors="pt")["input_ids"][0].tolist()
    pad = theirs.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == _our_qwen_image_tokens(load_processor(folder)) > 16


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_an_image_dict_without_its_type_takes_the_model_type(tmp_path, tiny_dir, family):
    """transformers' saved nested dicts may leave out "image_processor_type"; `AutoImageProcessor` then picks the
    class by config.json's model_type. We refused such a folder ("image_processor_type '' is not supported")."""
    from transformers import AutoImageProcessor

    if family == "internvl":
        from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_processor

        folder = build_tiny_internvl_processor(tmp_path / "ivl")
    else:
        folder = tmp_path / "f"
        shutil.copytree(tiny_dir, folder)
    _write(folder / "config.json", {"model_type": family})  # a model folder's config (its defaults otherwise)
    image = _read(folder / "preprocessor_config.json")
    image.pop("image_processor_type")
    _nest(folder, image=image, video=_read(folder / "video_preprocessor_config.json"), keep_flat=False)
    ours = load_processor(folder)
    theirs = AutoImageProcessor.from_pretrained(folder)(images=[IMAGE])
    if family == "internvl":
        assert ours.num_tiles(IMAGE.height, IMAGE.width) == int(theirs["num_patches"][0])
    else:
        assert _our_qwen_image_tokens(ours) == int(theirs["image_grid_thw"].prod()) // 4


@pytest.mark.parametrize("model_type, expect", [
    ("no_such_model", r"processor_config.json\[image_processor\]: no image_processor_type, and config.json's "
                      r"model_type 'no_such_model'"),
    ("llava", r"processor_config.json\[image_processor\]: image_processor_type 'LlavaImageProcessor\w*' is not "
              r"supported"),  # a type transformers knows, not one of our families
])
def test_an_image_dict_whose_type_is_unknown_or_unsupported_is_refused_naming_it(tmp_path, tiny_dir, model_type,
                                                                                    expect):
    folder = tmp_path / "f"
    shutil.copytree(tiny_dir, folder)
    image = _read(folder / "preprocessor_config.json")
    image.pop("image_processor_type")
    _nest(folder, image=image, video=None, keep_flat=False)
    _write(folder / "config.json", {"model_type": model_type})
    with pytest.raises(NotImplementedError, match=expect):
        load_processor(folder)
