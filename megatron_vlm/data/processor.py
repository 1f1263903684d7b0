"""The model folder's processor, usable with or without torchvision: `load_processor(path)`.

Why not just `AutoProcessor.from_pretrained`? transformers (5.x) builds a Qwen2-VL / Qwen2.5-VL
processor only together with its video processor, and every Qwen2-VL video processor imports
torchvision — so on a machine without torchvision (our CPU CI, many NPU images) no
`Qwen2_5_VLProcessor` can be built at all. `VLProcessor` holds the pieces that do not need it:

- the tokenizer (`AutoTokenizer`) and the folder's chat template (chat_template.jinja, else
  chat_template.json, else the tokenizer's own);
- transformers' PIL image processor (`Qwen2VLImageProcessorPil`, the same on every machine, so
  pixel values do not depend on whether torchvision happens to be installed);
- video processing of frame lists done here with that image processor: each frame is resized /
  normalised exactly like an image, then frames are paired along time (temporal patch 2) into the
  layout of transformers' `Qwen2VLVideoProcessor` (rows t, h/m, w/m, m, m; features C, t_p, p, p;
  an odd frame count repeats the last frame).

The placeholder expansion and tokenisation that `Qwen2_5_VLProcessor.__call__` does are in
`processing.py`; tests check both against the real `Qwen2_5_VLProcessor`.
Families: Qwen2-VL-style folders (Qwen2-VL, Qwen2.5-VL). Others raise NotImplementedError naming
the folder's image processor type.
"""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["VLProcessor", "load_processor", "as_vl_processor"]

_QWEN2_VL_IMAGE_PROCESSORS = {
    "Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil",
}


def _kind(item: dict) -> str:
    t = item.get("type")
    if t in ("image", "video", "text"):
        return t
    if t == "image_url" or "image" in item or "image_url" in item:
        return "image"
    return "video" if "video" in item else "text"


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


class VLProcessor:
    """Tokenizer + chat template + image processor + frame-list video processing (Qwen2-VL style)."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"
    # ChatML turn markers: what the labels mask looks for in the rendered conversation.
    assistant_header = "<|im_start|>assistant\n"
    turn_end = "<|im_end|>"

    def __init__(self, tokenizer, image_processor, *, chat_template: str, image_min_pixels: int,
                 image_max_pixels: int, video_min_pixels: int, video_max_pixels: int, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2, name_or_path: str = ""):
        if not chat_template:
            raise ValueError(f"{name_or_path or 'processor'}: no chat template (chat_template.jinja / "
                             "chat_template.json / tokenizer_config.json)")
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.image_min_pixels = int(image_min_pixels)
        self.image_max_pixels = int(image_max_pixels)
        self.video_min_pixels = int(video_min_pixels)
        self.video_max_pixels = int(video_max_pixels)
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.merge_size = int(merge_size)
        self.name_or_path = str(name_or_path)
        self.image_token_id = self._token_id(self.image_token)
        self.video_token_id = self._token_id(self.video_token)
        self.vision_start_token_id = self._token_id(self.vision_start_token)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Structural tokens user text must not contain (they would fake placeholders or turns);
        # other special tokens (e.g. Qwen's <|box_start|> for grounding) are legitimate text.
        self.special_strings = tuple(t for t in (
            self.image_token, self.video_token, self.vision_start_token, self.vision_end_token,
            "<|im_start|>", self.turn_end, tokenizer.eos_token, tokenizer.pad_token) if t)

    def _token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or (self.tokenizer.unk_token_id is not None and tid == self.tokenizer.unk_token_id):
            raise ValueError(f"{self.name_or_path or 'tokenizer'}: special token {token} is not in the vocabulary")
        return int(tid)

    # ------------------------------------------------------------------ configuration
    def with_overrides(self, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                       video_min_pixels: Optional[int] = None, video_max_pixels: Optional[int] = None) -> "VLProcessor":
        """A copy with the [data] section's pixel limits applied (None keeps the folder's value)."""
        out = copy.copy(self)
        if min_pixels is not None:
            out.image_min_pixels = int(min_pixels)
        if max_pixels is not None:
            out.image_max_pixels = int(max_pixels)
        if video_min_pixels is not None:
            out.video_min_pixels = int(video_min_pixels)
        if video_max_pixels is not None:
            out.video_max_pixels = int(video_max_pixels)
        for kind in ("image", "video"):
            lo, hi = getattr(out, f"{kind}_min_pixels"), getattr(out, f"{kind}_max_pixels")
            if lo > hi:
                raise ValueError(f"{kind} min_pixels {lo} is larger than max_pixels {hi}")
        return out

    @property
    def image_size_kwargs(self) -> dict:
        return {"shortest_edge": self.image_min_pixels, "longest_edge": self.image_max_pixels}

    @property
    def video_size_kwargs(self) -> dict:
        return {"shortest_edge": self.video_min_pixels, "longest_edge": self.video_max_pixels}

    # ------------------------------------------------------------------ text
    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text through the folder's chat template (placeholders unexpanded)."""
        conversation = []
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                content = [{"type": "text", "text": it["text"]} if _kind(it) == "text" else {"type": _kind(it)}
                           for it in content]
            conversation.append({"role": m["role"], "content": content})
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ transformers-processor look-alike
    def apply_chat_template(self, conversation: list[dict], *, tokenize: bool = False,
                            add_generation_prompt: bool = False, **_unused) -> str:
        """Like `ProcessorMixin.apply_chat_template(..., tokenize=False)`: the rendered text."""
        if tokenize:
            raise NotImplementedError("VLProcessor.apply_chat_template renders text only; call the processor on it")
        return self.render(conversation, add_generation_prompt=add_generation_prompt)

    def __call__(self, text=None, images=None, videos=None, *, return_tensors: str = "pt", padding=False,
                 padding_side: Optional[str] = None, fps: float = 2.0, **_unused):
        """Like `Qwen2_5_VLProcessor.__call__`: expand placeholders of `text` (str or list) for
        `images` (PIL, in order) and `videos` (lists of equal-sized PIL frames at `fps`), tokenise,
        and return input_ids, attention_mask, mm_token_type_ids and the vision tensors."""
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text or [])
        images = [images] if images is not None and not isinstance(images, (list, tuple)) else list(images or [])
        videos = list(videos or [])
        data: dict[str, Any] = {}
        image_counts, video_counts = [], []
        if images:
            data.update(self.preprocess_images(images))
            image_counts = [self.num_tokens(g) for g in data["image_grid_thw"]]
        if videos:
            parts = [self.preprocess_video(list(v), fps) for v in videos]
            for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
                data[key] = torch.cat([p[key] for p in parts])
            video_counts = [self.num_tokens(g) for g in data["video_grid_thw"]]
        expanded = []
        for t in texts:
            for token, counts in ((self.image_token, image_counts), (self.video_token, video_counts)):
                pieces = t.split(token)
                if len(pieces) - 1 > len(counts):
                    raise ValueError(f"more {token} placeholders in the text than inputs ({len(counts)})")
                t = pieces[0] + "".join(token * counts.pop(0) + piece for piece in pieces[1:])
            expanded.append(t)
        if image_counts or video_counts:
            raise ValueError(f"{len(image_counts)} images / {len(video_counts)} videos have no placeholder in the text")
        kw = {"padding_side": padding_side} if padding_side else {}
        enc = self.tokenizer(expanded, padding=padding, return_tensors=return_tensors, **kw)
        ids = enc["input_ids"]
        mm = torch.zeros_like(ids) if torch.is_tensor(ids) else None
        if mm is not None:
            mm[ids == self.image_token_id] = 1
            mm[ids == self.video_token_id] = 2
            data["mm_token_type_ids"] = mm
        return BatchFeature({**enc, **data})

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    # ------------------------------------------------------------------ vision geometry
    def image_grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = _smart_resize(height, width, self.patch_size * self.merge_size,
                             self.image_min_pixels, self.image_max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def video_grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        h, w = _smart_resize(height, width, self.patch_size * self.merge_size,
                             self.video_min_pixels, self.video_max_pixels)
        return math.ceil(num_frames / self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid_thw) -> int:
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size ** 2)

    # ------------------------------------------------------------------ pixels
    def preprocess_images(self, images: list) -> dict[str, torch.Tensor]:
        """PIL images -> pixel_values [sum(t*h*w), C*tp*p*p] (float32) and image_grid_thw [n, 3]."""
        out = self.image_processor(images=images, size=self.image_size_kwargs, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].to(torch.float32),
                "image_grid_thw": out["image_grid_thw"].to(torch.long)}

    def preprocess_video(self, frames: list, fps: float) -> dict[str, torch.Tensor]:
        """Equal-sized PIL frames (already subsampled) sampled at `fps` -> pixel_values_videos
        [t*h*w, C*tp*p*p], video_grid_thw [1, 3], second_per_grid_ts [1] (= temporal_patch_size / fps)."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"video frames differ in size: {sorted(sizes)}")
        tp = self.temporal_patch_size
        frames = list(frames) + [frames[-1]] * (-len(frames) % tp)
        out = self.image_processor(images=frames, size=self.video_size_kwargs, return_tensors="np")
        pv = np.asarray(out["pixel_values"], dtype=np.float32)
        _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        s, p, k = gh * gw, self.patch_size, len(frames)
        c = pv.shape[-1] // (tp * p * p)
        # image rows carry each frame broadcast over tp; keep one copy, then pair frames along time.
        x = pv.reshape(k, s, c, tp, p, p)[:, :, :, 0]
        x = x.reshape(k // tp, tp, s, c, p, p).transpose(0, 2, 3, 1, 4, 5)
        pixel_values_videos = torch.from_numpy(np.ascontiguousarray(x).reshape(k // tp * s, c * tp * p * p))
        return {
            "pixel_values_videos": pixel_values_videos,
            "video_grid_thw": torch.tensor([[k // tp, gh, gw]], dtype=torch.long),
            "second_per_grid_ts": torch.tensor([tp / float(fps)], dtype=torch.float32),
        }

    def __repr__(self) -> str:
        return (f"VLProcessor({self.name_or_path!r}, vocab={len(self.tokenizer)}, image_pixels=["
                f"{self.image_min_pixels}, {self.image_max_pixels}], video_pixels=[{self.video_min_pixels}, "
                f"{self.video_max_pixels}], patch={self.patch_size}, merge={self.merge_size})")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def _pixels(cfg: dict, lo_default: int, hi_default: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or lo_default
    hi = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or hi_default
    return int(lo), int(hi)


def _chat_template(folder: Path, tokenizer) -> str:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        tpl = _read_json(folder / "chat_template.json").get("chat_template")
        if tpl:
            return tpl
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    return tpl or ""


def load_processor(path: str | os.PathLike, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                   video_min_pixels: Optional[int] = None, video_max_pixels: Optional[int] = None) -> VLProcessor:
    """Load the tokenizer, chat template and image / video settings of a model folder (offline)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(path)
    pre_path = folder / "preprocessor_config.json"
    if not pre_path.is_file():
        raise FileNotFoundError(f"{folder}: no preprocessor_config.json (is this a vision-language model folder?)")
    pre = _read_json(pre_path)
    kind = pre.get("image_processor_type", "")
    if kind not in _QWEN2_VL_IMAGE_PROCESSORS:
        raise NotImplementedError(f"{pre_path}: image_processor_type {kind!r} is not supported yet "
                                  f"(supported: {sorted(_QWEN2_VL_IMAGE_PROCESSORS)})")
    vid_path = folder / "video_preprocessor_config.json"
    vid = _read_json(vid_path) if vid_path.is_file() else pre
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    img_lo, img_hi = _pixels(pre, 56 * 56, 28 * 28 * 1280)
    vid_lo, vid_hi = _pixels(vid, 128 * 28 * 28, 768 * 28 * 28)
    proc = VLProcessor(
        tokenizer, image_processor, chat_template=_chat_template(folder, tokenizer),
        image_min_pixels=img_lo, image_max_pixels=img_hi, video_min_pixels=vid_lo, video_max_pixels=vid_hi,
        patch_size=pre.get("patch_size", 14), temporal_patch_size=pre.get("temporal_patch_size", 2),
        merge_size=pre.get("merge_size", 2), name_or_path=str(folder),
    )
    return proc.with_overrides(min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                               video_max_pixels=video_max_pixels)


def as_vl_processor(obj: Any) -> VLProcessor:
    """A VLProcessor from a VLProcessor, a model folder path, or a transformers processor."""
    if isinstance(obj, VLProcessor):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return load_processor(obj)
    tokenizer = getattr(obj, "tokenizer", None)
    image_processor = getattr(obj, "image_processor", None)
    if tokenizer is None or image_processor is None:
        raise TypeError(f"expected a VLProcessor, a model folder or a transformers processor, got {type(obj).__name__}")
    size = dict(getattr(image_processor, "size", {}) or {})
    video = getattr(obj, "video_processor", None)
    vsize = dict(getattr(video, "size", {}) or {}) if video is not None else size
    return VLProcessor(
        tokenizer, image_processor,
        chat_template=getattr(obj, "chat_template", None) or getattr(tokenizer, "chat_template", None) or "",
        image_min_pixels=size.get("shortest_edge", 56 * 56), image_max_pixels=size.get("longest_edge", 28 * 28 * 1280),
        video_min_pixels=vsize.get("shortest_edge", 128 * 28 * 28),
        video_max_pixels=vsize.get("longest_edge", 768 * 28 * 28),
        patch_size=image_processor.patch_size, temporal_patch_size=image_processor.temporal_patch_size,
        merge_size=image_processor.merge_size, name_or_path=getattr(tokenizer, "name_or_path", ""),
    )
