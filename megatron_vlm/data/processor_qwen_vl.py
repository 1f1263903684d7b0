"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL processing without torchvision (`QwenVLProcessor`).

Images go through transformers' PIL image processor (`Qwen2VLImageProcessorPil`, the same on every
machine, so pixel values do not depend on whether torchvision happens to be installed): resize to
multiples of patch x merge within [min_pixels, max_pixels], normalise, patchify; each image's
`<|image_pad|>` becomes t*h*w/merge^2 copies.

Videos (frame lists, already subsampled) follow transformers' video processors of the family:
each frame is resized with the same PIL resize and normalised with the video processor's settings,
frames are paired along time (temporal patch 2; an odd count repeats the last frame) into the
patch layout (rows t, h/m, w/m, m, m; features C, t_p, p, p). The resize rule and the text differ:

* Qwen2-VL / 2.5-VL (`Qwen2VLVideoProcessor`): per-frame area limits (2-D smart_resize);
  `<|video_pad|>` becomes t*h*w/4 copies; `second_per_grid_ts` = temporal_patch / fps feeds M-RoPE.
* Qwen3-VL (`Qwen3VLVideoProcessor`, `Qwen3VLProcessor`): the limits bound the whole clip
  (t*h*w, 3-D smart_resize, optional per-frame cap); the template's `<|video_pad|>` becomes, per
  temporal patch, `<{t:.1f} seconds>` + `<|vision_start|>` + h*w/4 `<|video_pad|>` + `<|vision_end|>`
  with t the mean timestamp of the patch's two frames (source frame index / source fps); no
  second_per_grid_ts. A one-frame clip (which transformers rejects) is sized as two frames.

Qwen3-VL is recognised by its processor class (processor_config.json / preprocessor_config.json)
or its video processor type.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.expansion import Expansion, Run
from megatron_vlm.data.processor_base import FolderProcessorDicts, VisionItem, VLProcessor, special_token_id

__all__ = ["QwenVLProcessor", "QWEN_VL_IMAGE_PROCESSORS"]

QWEN_VL_IMAGE_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"})


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' resize rule; an image it refuses (aspect ratio over 200, e.g. a 4000 x 3 strip)
    is a bad record "unsupported_shape", not an unexpected error with a traceback."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ratio = max(height, width) / max(min(height, width), 1)
    if ratio > 200:
        raise BadRecordError("unsupported_shape", f"{width} x {height} pixels: aspect ratio {ratio:.1f} is over 200, "
                                                  "the limit of the Qwen-VL image processors")
    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def _pixels(cfg: dict, lo_default: int, hi_default: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or lo_default
    hi = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or hi_default
    return int(lo), int(hi)


class QwenVLProcessor(VLProcessor):
    """Tokenizer + chat template + PIL image processor + frame-list video processing (module docstring)."""

    family = "qwen_vl"
    returns_mm_token_type_ids = True
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"

    def __init__(self, tokenizer, image_processor, *, chat_template: str, image_min_pixels: int,
                 image_max_pixels: int, video_min_pixels: int, video_max_pixels: int, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2, name_or_path: str = "",
                 video_timestamps: bool = False, video_norm: Optional[dict] = None,
                 cap_pixels_per_frame: bool = False, max_video_tokens: int = 768):
        """video_timestamps: Qwen3-VL video layout (module docstring); video_norm: the video processor's
        do_resize / resample / do_rescale / rescale_factor / do_normalize / image_mean / image_std
        (default: the image processor's)."""
        ids = {t: special_token_id(tokenizer, t, name_or_path) for t in (
            "<|image_pad|>", "<|video_pad|>", self.vision_start_token, self.vision_end_token)}
        super().__init__(
            tokenizer, chat_template=chat_template, image_token="<|image_pad|>", video_token="<|video_pad|>",
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            structural_tokens=(self.vision_start_token, self.vision_end_token), name_or_path=name_or_path)
        self.image_processor = image_processor
        self.vision_start_token_id = ids[self.vision_start_token]
        self.image_min_pixels = int(image_min_pixels)
        self.image_max_pixels = int(image_max_pixels)
        self.video_min_pixels = int(video_min_pixels)
        self.video_max_pixels = int(video_max_pixels)
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.merge_size = int(merge_size)
        self.video_timestamps = bool(video_timestamps)
        self.cap_pixels_per_frame = bool(cap_pixels_per_frame)
        self.max_video_tokens = int(max_video_tokens)
        ip = image_processor
        norm = {"do_resize": getattr(ip, "do_resize", True), "resample": getattr(ip, "resample", 3),
                "do_rescale": getattr(ip, "do_rescale", True), "rescale_factor": getattr(ip, "rescale_factor", 1 / 255),
                "do_normalize": getattr(ip, "do_normalize", True), "image_mean": list(ip.image_mean),
                "image_std": list(ip.image_std)}
        norm.update({k: v for k, v in (video_norm or {}).items() if k in norm and v is not None})
        self.video_norm = norm

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_folder(cls, folder: Path, dicts: FolderProcessorDicts, tokenizer, chat_template: str) -> QwenVLProcessor:
        """From the folder's processor dicts as transformers reads them (`folder_processor_dicts`)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        pre, vid, proc_cfg = dicts.image or {}, dicts.video, dicts.processor
        qwen3 = "Qwen3VL" in str(proc_cfg.get("processor_class") or pre.get("processor_class") or "") or \
            str(vid.get("video_processor_type", "")).startswith("Qwen3VL")
        img_lo, img_hi = _pixels(pre, 56 * 56, 28 * 28 * 1280)
        vid_lo, vid_hi = _pixels(vid or pre, 128 * 32 * 32 if qwen3 else 128 * 28 * 28,
                                 32 * 32 * 768 if qwen3 else 768 * 28 * 28)
        return cls(
            tokenizer, Qwen2VLImageProcessorPil.from_dict(dict(pre)), chat_template=chat_template,
            image_min_pixels=img_lo, image_max_pixels=img_hi, video_min_pixels=vid_lo, video_max_pixels=vid_hi,
            patch_size=pre.get("patch_size", 14), temporal_patch_size=pre.get("temporal_patch_size", 2),
            merge_size=pre.get("merge_size", 2), name_or_path=str(folder), video_timestamps=qwen3,
            video_norm=vid, cap_pixels_per_frame=bool(vid.get("cap_pixels_per_frame")),
            max_video_tokens=vid.get("max_video_tokens", 768),
        )

    @classmethod
    def from_transformers(cls, obj: Any) -> QwenVLProcessor:
        """From a transformers Qwen2-VL-style processor object (tokenizer + image processor + video processor
        attributes): the video processor's size, normalisation and (Qwen3-VL) per-frame cap are kept, as a model
        folder's video_preprocessor_config.json is read (`from_folder`). Other families' processors are refused:
        their model folder gives the right processor."""
        tokenizer = getattr(obj, "tokenizer", None)
        image_processor = getattr(obj, "image_processor", None)
        if tokenizer is None or image_processor is None:
            raise TypeError(f"expected a VLProcessor, a model folder or a transformers processor, got {type(obj).__name__}")
        if not all(hasattr(image_processor, k) for k in ("patch_size", "temporal_patch_size", "merge_size")):
            raise TypeError(f"{type(obj).__name__} is not a Qwen-VL processor ({type(image_processor).__name__}); pass "
                            "its model folder instead, which picks the family's processor")
        qwen3 = type(obj).__name__.startswith("Qwen3VL")
        size = dict(getattr(image_processor, "size", {}) or {})
        video = getattr(obj, "video_processor", None)
        vsize = dict(getattr(video, "size", {}) or {})
        norm_keys = ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
        video_norm = {k: getattr(video, k, None) for k in norm_keys} if video is not None else None
        return cls(
            tokenizer, image_processor,
            chat_template=getattr(obj, "chat_template", None) or getattr(tokenizer, "chat_template", None) or "",
            image_min_pixels=size.get("shortest_edge", 56 * 56), image_max_pixels=size.get("longest_edge", 28 * 28 * 1280),
            video_min_pixels=vsize.get("shortest_edge", 128 * 32 * 32 if qwen3 else 128 * 28 * 28),
            video_max_pixels=vsize.get("longest_edge", 32 * 32 * 768 if qwen3 else 768 * 28 * 28),
            patch_size=image_processor.patch_size, temporal_patch_size=image_processor.temporal_patch_size,
            merge_size=image_processor.merge_size, name_or_path=getattr(tokenizer, "name_or_path", ""),
            video_timestamps=qwen3, video_norm=video_norm,
            cap_pixels_per_frame=bool(getattr(video, "cap_pixels_per_frame", False)),
            max_video_tokens=getattr(video, "max_video_tokens", None) or 768,
        )

    def with_overrides(self, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                       video_min_pixels: Optional[int] = None, video_max_pixels: Optional[int] = None) -> QwenVLProcessor:
        """A copy with the [data] section's pixel limits applied (None keeps the folder's value). For
        Qwen3-VL the video limits bound the whole clip (frames x height x width)."""
        out = copy.copy(self)
        for name, value in (("image_min_pixels", min_pixels), ("image_max_pixels", max_pixels),
                            ("video_min_pixels", video_min_pixels), ("video_max_pixels", video_max_pixels)):
            if value is not None:
                setattr(out, name, int(value))
        for kind in ("image", "video"):
            lo, hi = getattr(out, f"{kind}_min_pixels"), getattr(out, f"{kind}_max_pixels")
            if lo > hi:
                raise ValueError(f"{kind} min_pixels {lo} is larger than max_pixels {hi}")
        return out

    def identity(self) -> dict:
        return {"family": "qwen3_vl" if self.video_timestamps else "qwen2_vl",
                "pixels": [self.image_min_pixels, self.image_max_pixels, self.video_min_pixels, self.video_max_pixels],
                "patch": [self.patch_size, self.temporal_patch_size, self.merge_size],
                "video_cap": [self.cap_pixels_per_frame, self.max_video_tokens]}

    @property
    def image_size_kwargs(self) -> dict:
        return {"shortest_edge": self.image_min_pixels, "longest_edge": self.image_max_pixels}

    @property
    def video_size_kwargs(self) -> dict:
        return {"shortest_edge": self.video_min_pixels, "longest_edge": self.video_max_pixels}

    # ------------------------------------------------------------------ vision geometry
    def image_grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = _smart_resize(height, width, self.patch_size * self.merge_size,
                             self.image_min_pixels, self.image_max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def video_resized_hw(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The size every frame is resized to."""
        factor = self.patch_size * self.merge_size
        if not self.video_timestamps:
            return _smart_resize(height, width, factor, self.video_min_pixels, self.video_max_pixels)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        n = max(num_frames, self.temporal_patch_size)
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, max_pixels // n), int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * n
        return smart_resize(n, height, width, temporal_factor=self.temporal_patch_size, factor=factor,
                            min_pixels=self.video_min_pixels, max_pixels=max_pixels)

    def video_grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        h, w = self.video_resized_hw(num_frames, height, width)
        return math.ceil(num_frames / self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid_thw) -> int:
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size ** 2)

    # ------------------------------------------------------------------ expansions
    def _image_expansion(self, grid_thw) -> Expansion:
        return (Run(self.image_token, self.num_tokens(grid_thw)),)

    def _video_expansion(self, grid_thw, clip) -> Expansion:
        if not self.video_timestamps:
            return (Run(self.video_token, self.num_tokens(grid_thw)),)
        t, h, w = (int(x) for x in grid_thw)
        tp = self.temporal_patch_size
        idx = list(clip.indices) + [clip.indices[-1]] * (-clip.num_frames % tp)
        stamps = [idx[i] / clip.fps for i in range(len(idx))]
        parts: list = []
        for k in range(t):
            mean_t = (stamps[k * tp] + stamps[k * tp + tp - 1]) / 2
            parts += [f"<{mean_t:.1f} seconds>", self.vision_start_token,
                      Run(self.video_token, h * w // self.merge_size ** 2), self.vision_end_token]
        return tuple(parts)

    def image_expansions(self, sizes: list[tuple[int, int]]) -> list[Expansion]:
        return [self._image_expansion(self.image_grid_thw(h, w)) for h, w in sizes]

    def video_expansion(self, clip) -> Expansion:
        return self._video_expansion(self.video_grid_thw(clip.num_frames, clip.height, clip.width), clip)

    # ------------------------------------------------------------------ pixels
    def preprocess_images(self, images: list) -> dict[str, torch.Tensor]:
        """PIL images -> pixel_values [sum(t*h*w), C*tp*p*p] (float32) and image_grid_thw [n, 3]."""
        out = self.image_processor(images=images, size=self.image_size_kwargs, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].to(torch.float32),
                "image_grid_thw": out["image_grid_thw"].to(torch.long)}

    def process_images(self, images: list) -> list[VisionItem]:
        out = self.preprocess_images(images)
        items, start = [], 0
        for grid in out["image_grid_thw"]:
            n = int(grid.prod())
            items.append(VisionItem({"pixel_values": out["pixel_values"][start:start + n],
                                     "image_grid_thw": grid[None].clone()}, self._image_expansion(grid)))
            start += n
        return items

    def _normalised_frames(self, frames: list, height: int, width: int) -> np.ndarray:
        """[k, C, H', W'] float32: each frame resized (PIL), rescaled and normalised like the image processor."""
        from transformers.image_transforms import normalize, rescale, resize
        from transformers.image_utils import ChannelDimension

        n, first = self.video_norm, ChannelDimension.FIRST
        out = []
        for f in frames:
            x = np.moveaxis(np.asarray(f.convert("RGB")), -1, 0)
            if n["do_resize"]:
                x = resize(x, (height, width), resample=n["resample"], data_format=first, input_data_format=first)
            if n["do_rescale"]:
                x = rescale(x, n["rescale_factor"], data_format=first, input_data_format=first)
            if n["do_normalize"]:
                x = normalize(x, n["image_mean"], n["image_std"], data_format=first, input_data_format=first)
            out.append(np.asarray(x, dtype=np.float32))
        return np.stack(out)

    def preprocess_video(self, frames: list, fps: float) -> dict[str, torch.Tensor]:
        """Equal-sized PIL frames (already subsampled) sampled at `fps` -> pixel_values_videos
        [t*h*w, C*tp*p*p], video_grid_thw [1, 3] (+ second_per_grid_ts [1] = temporal_patch / fps
        for Qwen2-VL / 2.5-VL)."""
        from megatron_vlm.data.media import VideoClip

        if not frames:
            raise ValueError("a video needs at least one frame")
        clip = VideoClip(list(range(len(frames))), len(frames), float(fps), frames[0].height, frames[0].width, frames)
        return self.process_video(clip).tensors

    def process_video(self, clip) -> VisionItem:
        frames = clip.frames
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"video frames differ in size: {sorted(sizes)}")
        h, w = self.video_resized_hw(len(frames), clip.height, clip.width)
        x = self._normalised_frames(frames, h, w)
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if len(x) % tp:
            x = np.concatenate([x, np.repeat(x[-1:], tp - len(x) % tp, axis=0)])
        k, c = x.shape[:2]
        gt, gh, gw = k // tp, h // p, w // p
        x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        tensors = {"pixel_values_videos": torch.from_numpy(np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p)),
                   "video_grid_thw": torch.tensor([[gt, gh, gw]], dtype=torch.long)}
        if not self.video_timestamps:
            tensors["second_per_grid_ts"] = torch.tensor([tp / float(clip.effective_fps)], dtype=torch.float32)
        return VisionItem(tensors, self._video_expansion((gt, gh, gw), clip))

    def __repr__(self) -> str:
        return (f"QwenVLProcessor({self.name_or_path!r}, {'qwen3_vl' if self.video_timestamps else 'qwen2_vl'}, "
                f"vocab={len(self.tokenizer)}, image_pixels=[{self.image_min_pixels}, {self.image_max_pixels}], "
                f"video_pixels=[{self.video_min_pixels}, {self.video_max_pixels}], patch={self.patch_size}, "
                f"merge={self.merge_size})")
