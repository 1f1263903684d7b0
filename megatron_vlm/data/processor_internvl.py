"""InternVL processing without torchvision (`InternVLProcessor`), as transformers' `InternVLProcessor`.

Images: dynamic tiling by transformers' own PIL image processor (`GotOcr2ImageProcessorPil`,
`crop_to_patches=True` as InternVLProcessor forces it): the tile grid (1..max_patches tiles) whose
aspect ratio is closest to the image's, plus a thumbnail tile when there is more than one tile.
The template's `<IMG_CONTEXT>` becomes `<img>` + `<IMG_CONTEXT>` x image_seq_length x tiles +
`</img>`.

Videos: every frame is one tile — resized to the video processor's size (PIL, like the images) and
normalised with its mean / std — and the template's `<video>` becomes
`Frame1: <img>...</img>\\nFrame2: <img>...</img>...` (frames joined by a newline).

InternVL's forward has one `pixel_values` [tiles, 3, H, W]: image tiles and video frames are put
there in the order of their placeholders in the text (as InternVLProcessor does).

Token strings come from the tokenizer's `extra_special_tokens` (start_image_token, end_image_token,
context_image_token, video_token; transformers' names) and image_seq_length from
processor_config.json (else config.json's vision geometry, else 256).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_vlm.data.expansion import Expansion, Run
from megatron_vlm.data.processor_base import FolderProcessorDicts, VisionItem, VLProcessor, read_json, special_token_id

__all__ = ["InternVLProcessor", "INTERNVL_IMAGE_PROCESSORS"]

INTERNVL_IMAGE_PROCESSORS = frozenset({"GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", "GotOcr2ImageProcessorPil"})
_PIL_KEYS = ("size", "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
             "do_convert_rgb")


def _image_seq_length(folder: Path, proc_cfg: dict) -> int:
    if "image_seq_length" in proc_cfg:
        return int(proc_cfg["image_seq_length"])
    model_cfg = folder / "config.json"
    if model_cfg.is_file():
        cfg = read_json(model_cfg)
        vision = cfg.get("vision_config") or {}
        size, patch = vision.get("image_size"), vision.get("patch_size")
        size = size[0] if isinstance(size, (list, tuple)) else size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        if size and patch:
            return int((size // patch) ** 2 * cfg.get("downsample_ratio", 0.5) ** 2)
    return 256


class InternVLProcessor(VLProcessor):
    """Tokenizer + chat template + GotOcr2 tiling (module docstring)."""

    family = "internvl"

    def __init__(self, tokenizer, image_processor, video_processor, *, chat_template: str, image_seq_length: int,
                 name_or_path: str = ""):
        """image_processor: a `GotOcr2ImageProcessorPil` (tiling settings); video_processor: one whose
        size / mean / std are the video processor's (frames are not tiled)."""
        self.start_image_token = getattr(tokenizer, "start_image_token", None) or "<img>"
        self.end_image_token = getattr(tokenizer, "end_image_token", None) or "</img>"
        context = getattr(tokenizer, "context_image_token", None) or "<IMG_CONTEXT>"
        video = getattr(tokenizer, "video_token", None) or "<video>"
        for token in (self.start_image_token, self.end_image_token):
            special_token_id(tokenizer, token, name_or_path)
        super().__init__(tokenizer, chat_template=chat_template, image_token=context, video_token=video,
                         image_token_id=special_token_id(tokenizer, context, name_or_path), video_token_id=None,
                         structural_tokens=(self.start_image_token, self.end_image_token), name_or_path=name_or_path)
        if image_seq_length <= 0:
            raise ValueError(f"{name_or_path}: image_seq_length must be > 0, got {image_seq_length}")
        self.image_seq_length = int(image_seq_length)
        self.image_processor = image_processor
        self.video_processor = video_processor

    @classmethod
    def from_folder(cls, folder: Path, dicts: FolderProcessorDicts, tokenizer, chat_template: str) -> InternVLProcessor:
        """From the folder's processor dicts as transformers reads them (`folder_processor_dicts`)."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        image_processor = GotOcr2ImageProcessorPil.from_dict(dict(dicts.image or {}))
        vid = dicts.video
        video_kw = {k: getattr(image_processor, k) for k in _PIL_KEYS}
        video_kw.update({k: vid[k] for k in _PIL_KEYS if vid.get(k) is not None})
        video_processor = GotOcr2ImageProcessorPil(**video_kw, crop_to_patches=False)
        return cls(tokenizer, image_processor, video_processor, chat_template=chat_template,
                   image_seq_length=_image_seq_length(folder, dicts.processor), name_or_path=str(folder))

    def identity(self) -> dict:
        ip, vp = self.image_processor, self.video_processor
        return {"family": self.family, "image_seq_length": self.image_seq_length,
                "tiles": [dict(ip.size), ip.min_patches, ip.max_patches], "video_size": dict(vp.size)}

    # ------------------------------------------------------------------ expansions
    def _image_expansion(self, tiles: int) -> Expansion:
        return (self.start_image_token, Run(self.image_token, self.image_seq_length * tiles), self.end_image_token)

    def _video_expansion(self, num_frames: int) -> Expansion:
        parts: list = []
        for i in range(num_frames):
            parts += [("\n" if i else "") + f"Frame{i + 1}: ", *self._image_expansion(1)]
        return tuple(parts)

    def num_tiles(self, height: int, width: int) -> int:
        return int(self.image_processor.get_number_of_image_patches(height, width, {"crop_to_patches": True}))

    def image_expansions(self, sizes: list[tuple[int, int]]) -> list[Expansion]:
        return [self._image_expansion(self.num_tiles(h, w)) for h, w in sizes]

    def video_expansion(self, clip) -> Expansion:
        return self._video_expansion(clip.num_frames)

    # ------------------------------------------------------------------ pixels
    def process_images(self, images: list) -> list[VisionItem]:
        out = self.image_processor(images=images, crop_to_patches=True, return_tensors="pt")
        tiles = out["pixel_values"].to(torch.float32)
        items, start = [], 0
        for n in (int(x) for x in out["num_patches"]):
            items.append(VisionItem({"pixel_values": tiles[start:start + n]}, self._image_expansion(n)))
            start += n
        return items

    def process_video(self, clip) -> VisionItem:
        frames = self.video_processor(images=clip.frames, crop_to_patches=False, return_tensors="pt")["pixel_values"]
        return VisionItem({"pixel_values": frames.to(torch.float32)}, self._video_expansion(len(clip.frames)))

    def __repr__(self) -> str:
        ip = self.image_processor
        return (f"InternVLProcessor({self.name_or_path!r}, vocab={len(self.tokenizer)}, tile={dict(ip.size)}, "
                f"tiles=[{ip.min_patches}, {ip.max_patches}], image_seq_length={self.image_seq_length})")
