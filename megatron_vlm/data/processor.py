"""The model folder's processor, usable with or without torchvision: `load_processor(path)`.

Why not just `AutoProcessor.from_pretrained`? transformers (5.x) builds the processors of these
families only together with their video processors, and those import torchvision (Nemotron-H
Omni's image processor too) — so on a machine without torchvision (our CPU CI, many NPU images)
the processors cannot be built at all. `VLProcessor` holds what the data pipeline needs and builds
it from pieces that run without torchvision: the tokenizer, the folder's chat template
(chat_template.jinja, else chat_template.json, else the tokenizer's own) and, per family, the
image / video preprocessing and the placeholder expansion (`expansion.py`) of transformers'
processor for that family:

    Qwen2-VL / Qwen2.5-VL / Qwen3-VL   processor_qwen_vl.QwenVLProcessor
    InternVL (GotOcr2 tiling)          processor_internvl.InternVLProcessor
    Nemotron-3-Nano-VL (nemotron_h_omni) processor_nemotron_vl.NemotronVLProcessor
    text-only models (qwen2 / qwen3 / ...)  processor_text.TextProcessor (tokenizer only, no pixels)

`load_processor` picks the family from the image processor's `image_processor_type`, its settings read as
transformers reads them (processor_config.json's nested "image_processor" / "video_processor" first, then
preprocessor_config.json / video_preprocessor_config.json: `folder_processor_dicts`); a folder without
image processor settings whose config.json has no vision_config gets the text-only processor. The
per-record pipeline (`processing.py`) talks to a processor only through the hooks defined here:
`process_images` / `process_video` (pixels + one `Expansion` per item), `image_expansions` /
`video_expansion` (the same expansions from sizes alone, for exact length planning), the
placeholder strings of the chat template output and the run tokens the model fills with features.
`__call__` / `apply_chat_template` give the transformers-processor look-alike (text batches).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.processor_base import (
    VisionItem,
    VLProcessor,
    concat_in_order,
    folder_chat_template,
    folder_processor_dicts,
    read_json,
    special_token_id,
)
from megatron_vlm.data.processor_internvl import INTERNVL_IMAGE_PROCESSORS, InternVLProcessor
from megatron_vlm.data.processor_nemotron_vl import NEMOTRON_VL_IMAGE_PROCESSORS, NemotronVLProcessor
from megatron_vlm.data.processor_qwen_vl import QWEN_VL_IMAGE_PROCESSORS, QwenVLProcessor
from megatron_vlm.data.processor_text import is_text_model_folder, load_text_processor

__all__ = ["VisionItem", "VLProcessor", "concat_in_order", "folder_chat_template", "read_json", "special_token_id",
           "load_processor", "as_vl_processor"]


def _family_class(image_processor_type: str, source: str):
    families = ((QWEN_VL_IMAGE_PROCESSORS, QwenVLProcessor), (INTERNVL_IMAGE_PROCESSORS, InternVLProcessor),
                (NEMOTRON_VL_IMAGE_PROCESSORS, NemotronVLProcessor))
    for names, cls in families:
        if image_processor_type in names:
            return cls
    supported = sorted(n for names, _ in families for n in names)
    raise NotImplementedError(f"{source}: image_processor_type {image_processor_type!r} is not supported "
                              f"(supported: {supported})")


def _image_processor_type(image: dict, folder: Path, source: str) -> str:
    """The image processor's class name as transformers' `AutoImageProcessor` finds it: the dict's
    "image_processor_type", else its legacy "feature_extractor_type", else config.json's model_type through
    transformers' own model-type table (saved nested dicts may leave the type out)."""
    name = image.get("image_processor_type") or ""
    if not name and isinstance(image.get("feature_extractor_type"), str):
        name = image["feature_extractor_type"].replace("FeatureExtractor", "ImageProcessor")
    if name:
        return name
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str):
        from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

        names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or ()
        names = list(names.values()) if isinstance(names, dict) else [names] if isinstance(names, str) else list(names)
        for candidate in names:
            if isinstance(candidate, str):
                return candidate
    raise NotImplementedError(f"{source}: no image_processor_type, and config.json's model_type {model_type!r} names "
                              "no image processor transformers knows (set \"image_processor_type\", e.g. "
                              "\"Qwen2VLImageProcessor\")")


def load_processor(path: str | os.PathLike, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                   video_min_pixels: Optional[int] = None, video_max_pixels: Optional[int] = None,
                   chat_template_kwargs: Optional[dict] = None) -> VLProcessor:
    """Load the tokenizer, chat template and image / video settings of a model folder (offline); the [data]
    section's pixel limits and chat-template variables applied."""
    proc = _load_processor(path, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                           video_max_pixels=video_max_pixels)
    return proc.with_template_kwargs(chat_template_kwargs or {})


def _load_processor(path: str | os.PathLike, *, min_pixels: Optional[int], max_pixels: Optional[int],
                    video_min_pixels: Optional[int], video_max_pixels: Optional[int]) -> VLProcessor:
    from transformers import AutoTokenizer

    folder = Path(path)
    dicts = folder_processor_dicts(folder)
    if dicts.image is None:
        if is_text_model_folder(folder):
            return load_text_processor(folder).with_overrides(
                min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                video_max_pixels=video_max_pixels)
        raise FileNotFoundError(f"{folder}: no preprocessor_config.json (nor an \"image_processor\" in "
                                "processor_config.json) and not a text-only model folder "
                                "(config.json without vision_config + a tokenizer)")
    cls = _family_class(_image_processor_type(dicts.image, folder, dicts.image_source), dicts.image_source)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    proc = cls.from_folder(folder, dicts, tokenizer, folder_chat_template(folder, tokenizer))
    return proc.with_overrides(min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                               video_max_pixels=video_max_pixels)


def as_vl_processor(obj: Any) -> VLProcessor:
    """A VLProcessor from a VLProcessor, a model folder path, or a transformers Qwen2-VL-style processor."""
    if isinstance(obj, VLProcessor):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return load_processor(obj)
    return QwenVLProcessor.from_transformers(obj)
