"""Nemotron-3-Nano-VL (`nemotron_h_omni`) processing without torchvision (`NemotronVLProcessor`).

transformers' Nemotron-H Omni image processor imports torchvision, so its steps are done here
with torch, following `image_processing_nemotron_h_omni.py`, `video_processing_nemotron_h_omni.py`
and `processing_nemotron_h_omni.py`:

Images (all images of one record / call share one patch budget, as in one transformers call):
budget = max((max_model_len - 4) * merge^2, min_num_patches * images), capped by max_num_patches
and at least min_num_patches; each image gets the patch grid of `patch_grid_size` (close to its
own 16-pixel grid, scaled into [min_num_patches, budget], both sides multiples of merge = 1 /
downsample_ratio), is resized to it in float32 (bicubic with antialiasing, what torchvision's
resize does on float tensors, so overshoot is kept) and normalised ((x / 255 - mean) / std, CLIP
statistics by default). pixel_values [total_patches, 3*p*p]: patches row-major, each patch
channel-major (C, p, p). The grid is returned as `image_grid_thw` [n, 3] with t = 1 (the model
takes it in place of transformers' `image_grid_hw`). `<image>` becomes `<img>` + `<image>` x
(h*w / merge^2) + `</img>`.

Videos: every frame is resized (same bicubic) to one aspect-preserving tile of about
`video_target_num_patches` patches (sides multiples of merge) and normalised with the video
processor's norm_mean / norm_std; pixel_values_videos [frames, 3, H, W]. The template's `<video>`
becomes one `<img>` + `<image>` x tokens + `</img>` chunk per tubelet (video_temporal_patch_dim
frames), each labelled "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: ",
chunks joined by newlines. Frames are padded to a whole tubelet by repeating the last frame (the
model repeats it too); that keeps the tubelets of several videos in one pack apart.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.expansion import Expansion, Run
from megatron_vlm.data.processor_base import FolderProcessorDicts, VisionItem, VLProcessor, special_token_id

__all__ = ["NemotronVLProcessor", "NEMOTRON_VL_IMAGE_PROCESSORS", "patch_grid_size", "video_target_patches"]

NEMOTRON_VL_IMAGE_PROCESSORS = frozenset({"NemotronH_Omni_Reasoning_V3ImageProcessor"})
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes -> interpolate modes


def patch_grid_size(height: int, width: int, patch_size: int, merge_size: int, min_num_patches: int,
                    max_num_patches: int) -> tuple[int, int]:
    """(grid_h, grid_w) an image is resized to (Nemotron-H Omni's rule, module docstring). An image so
    thin that scaling it into max_num_patches leaves a side of 0 patches (transformers' rule divides by
    zero there) is a bad record "unsupported_shape"."""
    gh, gw = _own_grid(height, patch_size), _own_grid(width, patch_size)
    scale = min(math.sqrt(max_num_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(scale * gh), math.floor(scale * gw)
    if gh * gw == 0:
        raise BadRecordError("unsupported_shape", f"{width} x {height} pixels: a side scales to 0 patches within "
                                                  f"max_num_patches = {max_num_patches} (aspect ratio too extreme)")
    if max_num_patches > min_num_patches and gh * gw < min_num_patches:
        scale = math.sqrt(min_num_patches / (gh * gw))
        gh, gw = math.ceil(scale * gh), math.ceil(scale * gw)
    if gh % merge_size:
        up = gh + merge_size - gh % merge_size
        gh = up if up * gw <= max_num_patches else max(merge_size, gh - gh % merge_size)
    if gw % merge_size:
        up = gw + merge_size - gw % merge_size
        gw = up if gh * up <= max_num_patches else max(merge_size, gw - gw % merge_size)
    return gh, gw


def _own_grid(side: int, patch_size: int) -> int:
    # Python's round() rounds halves to even: round(k + 0.5) is k for even k, k + 1 for odd k, when
    # side / patch_size is a whole number k; otherwise it is floor(side / patch_size) + 1.
    return round(side / patch_size + 0.5)


def video_target_patches(height: int, width: int, target: int, merge_size: int, keep_aspect: bool) -> tuple[int, int]:
    """(h_patches, w_patches) of a video frame's tile: about `target` patches, sides multiples of merge."""
    if not keep_aspect:
        side = max(merge_size, int(math.sqrt(target)) // merge_size * merge_size)
        return side, side
    aspect = width / max(height, 1)
    ph, pw = max(round(math.sqrt(target / aspect)), 1), max(round(math.sqrt(target * aspect)), 1)
    if merge_size > 1:
        up_h, up_w = ph + (-ph % merge_size), pw + (-pw % merge_size)
        if up_h * up_w <= target:
            ph, pw = up_h, up_w
        else:
            ph, pw = max(merge_size, ph - ph % merge_size), max(merge_size, pw - pw % merge_size)
    return ph, pw


class NemotronVLProcessor(VLProcessor):
    """Tokenizer + chat template + Nemotron-H Omni image / video preprocessing (module docstring)."""

    family = "nemotron_vl"

    def __init__(self, tokenizer, *, chat_template: str, patch_size: int = 16, downsample_ratio: float = 0.5,
                 min_num_patches: int = 1024, max_num_patches: int = 13312, max_model_len: int = 16384,
                 resample: int = 3, rescale_factor: float = 1 / 255, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
                 video_target_num_patches: int = 1024, video_maintain_aspect_ratio: bool = True,
                 video_mean=None, video_std=None, video_temporal_patch_dim: int = 2, name_or_path: str = ""):
        image = getattr(tokenizer, "image_token", None) or "<image>"
        video = getattr(tokenizer, "video_token", None) or "<video>"  # text only: videos use the image token
        self.image_start_token = getattr(tokenizer, "image_start_token", None) or "<img>"
        self.image_end_token = getattr(tokenizer, "image_end_token", None) or "</img>"
        for token in (self.image_start_token, self.image_end_token):
            special_token_id(tokenizer, token, name_or_path)
        super().__init__(tokenizer, chat_template=chat_template, image_token=image, video_token=video,
                         image_token_id=special_token_id(tokenizer, image, name_or_path), video_token_id=None,
                         structural_tokens=(self.image_start_token, self.image_end_token), name_or_path=name_or_path)
        if resample not in _MODES:
            raise ValueError(f"{name_or_path}: resample {resample} is not supported (2 bilinear, 3 bicubic)")
        self.patch_size = int(patch_size)
        self.merge_size = round(1 / downsample_ratio)
        self.min_num_patches, self.max_num_patches = int(min_num_patches), int(max_num_patches)
        self.max_model_len = int(max_model_len)
        self.resample = int(resample)
        self.rescale_factor = float(rescale_factor)
        self.image_mean, self.image_std = [float(x) for x in image_mean], [float(x) for x in image_std]
        self.video_target_num_patches = int(video_target_num_patches)
        self.video_maintain_aspect_ratio = bool(video_maintain_aspect_ratio)
        self.video_mean = [float(x) for x in (video_mean or self.image_mean)]
        self.video_std = [float(x) for x in (video_std or self.image_std)]
        self.video_temporal_patch_dim = int(video_temporal_patch_dim)

    @classmethod
    def from_folder(cls, folder: Path, dicts: FolderProcessorDicts, tokenizer, chat_template: str) -> NemotronVLProcessor:
        """From the folder's processor dicts as transformers reads them (`folder_processor_dicts`)."""
        pre, vid, proc_cfg = dicts.image or {}, dicts.video, dicts.processor
        if pre.get("do_resize") is False or pre.get("do_rescale") is False or pre.get("do_normalize") is False:
            raise ValueError(f"{dicts.image_source}: do_resize / do_rescale / do_normalize = false is "
                             "not supported for Nemotron-VL")
        keys = ("patch_size", "downsample_ratio", "min_num_patches", "max_num_patches", "max_model_len", "resample",
                "rescale_factor")
        kw = {k: pre[k] for k in keys if pre.get(k) is not None}
        return cls(
            tokenizer, chat_template=chat_template, **kw,
            image_mean=pre.get("image_mean") or pre.get("norm_mean") or _CLIP_MEAN,
            image_std=pre.get("image_std") or pre.get("norm_std") or _CLIP_STD,
            video_target_num_patches=vid.get("video_target_num_patches", 1024),
            video_maintain_aspect_ratio=vid.get("video_maintain_aspect_ratio", True),
            video_mean=vid.get("norm_mean"), video_std=vid.get("norm_std"),
            video_temporal_patch_dim=proc_cfg.get("video_temporal_patch_dim", 2), name_or_path=str(folder),
        )

    def identity(self) -> dict:
        return {"family": self.family, "patch": [self.patch_size, self.merge_size],
                "budget": [self.min_num_patches, self.max_num_patches, self.max_model_len],
                "video": [self.video_target_num_patches, self.video_maintain_aspect_ratio, self.video_temporal_patch_dim]}

    # ------------------------------------------------------------------ geometry
    def patch_budget(self, num_images: int) -> int:
        """Patches per image when `num_images` images are processed together."""
        budget = max((self.max_model_len - 4) * self.merge_size ** 2, self.min_num_patches * num_images)
        if self.max_num_patches:
            budget = min(budget, self.max_num_patches)
        return max(budget, self.min_num_patches)

    def image_grid(self, height: int, width: int, num_images: int) -> tuple[int, int]:
        return patch_grid_size(height, width, self.patch_size, self.merge_size, self.min_num_patches,
                               self.patch_budget(num_images))

    def video_grid(self, height: int, width: int) -> tuple[int, int]:
        return video_target_patches(height, width, self.video_target_num_patches, self.merge_size,
                                    self.video_maintain_aspect_ratio)

    # ------------------------------------------------------------------ expansions
    def _chunk(self, tokens: int) -> tuple:
        return (self.image_start_token, Run(self.image_token, tokens), self.image_end_token)

    def image_expansions(self, sizes: list[tuple[int, int]]) -> list[Expansion]:
        return [self._chunk(gh * gw // self.merge_size ** 2) for gh, gw in
                (self.image_grid(h, w, len(sizes)) for h, w in sizes)]

    def video_expansion(self, clip) -> Expansion:
        gh, gw = self.video_grid(clip.height, clip.width)
        tokens, tpd = gh * gw // self.merge_size ** 2, self.video_temporal_patch_dim
        frame_ms = int(1000.0 / clip.fps)
        parts: list = []
        for g in range(math.ceil(clip.num_frames / tpd)):
            labels = [f"{'Frame' if i == g * tpd else 'frame'} {i + 1} sampled at "
                      f"{int(clip.indices[i]) * frame_ms / 1000.0:.2f} seconds"
                      for i in range(g * tpd, min((g + 1) * tpd, clip.num_frames))]
            parts += [("\n" if g else "") + " and ".join(labels) + ": ", *self._chunk(tokens)]
        return tuple(parts)

    def video_frame_shape(self, clip) -> Optional[tuple[int, ...]]:
        """Frames keep their video's tile size: [frames, 3, H, W] (`process_video`)."""
        gh, gw = self.video_grid(clip.height, clip.width)
        return (3, gh * self.patch_size, gw * self.patch_size)

    # ------------------------------------------------------------------ pixels
    def _resize(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[N, C, H, W] float32 -> [N, C, height, width] (antialiased, no clamping)."""
        if tuple(x.shape[-2:]) == (height, width):
            return x
        return F.interpolate(x, size=(height, width), mode=_MODES[self.resample], align_corners=False, antialias=True)

    @staticmethod
    def _to_float(images: list) -> list[torch.Tensor]:
        return [torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).to(torch.float32) for im in images]

    def _normalize(self, x: torch.Tensor, mean, std) -> torch.Tensor:
        # rescale folded into mean / std as transformers' torchvision backend does
        m = torch.tensor(mean, dtype=torch.float32) * (1.0 / self.rescale_factor)
        s = torch.tensor(std, dtype=torch.float32) * (1.0 / self.rescale_factor)
        return (x - m[:, None, None]) / s[:, None, None]

    def process_images(self, images: list) -> list[VisionItem]:
        p, items = self.patch_size, []
        for x in self._to_float(images):
            gh, gw = self.image_grid(x.shape[1], x.shape[2], len(images))
            x = self._normalize(self._resize(x[None], gh * p, gw * p)[0], self.image_mean, self.image_std)
            c = x.shape[0]
            patches = x.reshape(c, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, c * p * p)
            items.append(VisionItem({"pixel_values": patches.contiguous(),
                                     "image_grid_thw": torch.tensor([[1, gh, gw]], dtype=torch.long)},
                                    self._chunk(gh * gw // self.merge_size ** 2)))
        return items

    def process_video(self, clip) -> VisionItem:
        gh, gw = self.video_grid(clip.height, clip.width)
        x = torch.stack(self._to_float(clip.frames))
        x = self._resize(x, gh * self.patch_size, gw * self.patch_size)
        # frames / 255 then mean / std, as the video processor writes it
        x = (x / 255.0 - torch.tensor(self.video_mean).view(1, 3, 1, 1)) / torch.tensor(self.video_std).view(1, 3, 1, 1)
        if pad := -len(x) % self.video_temporal_patch_dim:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        return VisionItem({"pixel_values_videos": x.contiguous()}, self.video_expansion(clip))

    def __repr__(self) -> str:
        return (f"NemotronVLProcessor({self.name_or_path!r}, vocab={len(self.tokenizer)}, patch={self.patch_size}, "
                f"patches=[{self.min_num_patches}, {self.max_num_patches}], max_model_len={self.max_model_len})")
