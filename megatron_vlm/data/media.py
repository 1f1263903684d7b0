"""Images and videos of a record: open / decode, sizes from file headers, frame subsampling.

An image reference is a path, bytes, a HF-datasets `{"bytes", "path"}` dict or a PIL image. A video
is a list of frame references, a folder of frames (sorted by name) or a video file (decoded through
transformers' video loader when a backend such as PyAV is installed). `read_video` returns a
`VideoClip`: the frames kept after uniform subsampling to `max_frames`, their indices in the source
and the source frame rate — what the processors need for pixels and for timestamps in the text
(Qwen3-VL's `<t seconds>`, Nemotron-VL's "sampled at t seconds"). With `decode=False` only the first
frame's header is read (the token count of a video needs its size, not its pixels).

Problems raise `BadRecordError`: missing_image / corrupt_image / video (undecodable, frames that
differ in size).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image, UnidentifiedImageError

from megatron_vlm.data.bad_records import BadRecordError

__all__ = ["VideoClip", "load_image", "image_hw", "read_video", "subsample_indices", "describe"]

_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def describe(ref: Any) -> str:
    """A short name of an image / video reference for error messages."""
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, dict):
        return str(ref.get("path") or f"<{len(ref.get('bytes') or b'')} bytes>")
    if isinstance(ref, Image.Image):
        return f"<PIL {ref.size}>"
    return str(ref)


def _open(ref: Any) -> Image.Image:
    """Open lazily (header only); raises BadRecordError for missing / unreadable files."""
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict):  # HF datasets Image(decode=False): {"bytes": ..., "path": ...}
        ref = ref.get("bytes") or ref.get("path")
    try:
        if isinstance(ref, (bytes, bytearray)):
            return Image.open(io.BytesIO(ref))
        if isinstance(ref, str):
            if not os.path.isfile(ref):
                raise BadRecordError("missing_image", f"file not found: {ref}")
            return Image.open(ref)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRecordError("corrupt_image", f"{describe(ref)}: {e}") from None
    raise BadRecordError("invalid_record", f"unsupported image reference {type(ref).__name__}")


def image_hw(ref: Any) -> tuple[int, int]:
    """(height, width) from the file header, without decoding pixels."""
    w, h = _open(ref).size
    return h, w


def load_image(ref: Any) -> Image.Image:
    """Decode fully to RGB; truncated or corrupt data raises BadRecordError("corrupt_image")."""
    img = _open(ref)
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise BadRecordError("corrupt_image", f"{describe(ref)}: {e}") from None


def subsample_indices(n: int, max_frames: int) -> list[int]:
    """Uniformly spread `min(n, max_frames)` indices over n frames (first and last included)."""
    if n <= max_frames:
        return list(range(n))
    return [int(round(x)) for x in np.linspace(0, n - 1, max_frames)]


@dataclass
class VideoClip:
    """The frames of one video item that the model sees."""

    indices: list[int]
    """Indices of the kept frames in the source (ascending)."""
    total_frames: int
    """Frames in the source before subsampling."""
    fps: float
    """Frame rate of the source (the item's "fps", the file's, else the [data] default)."""
    height: int
    width: int
    frames: Optional[list[Image.Image]] = None
    """Decoded RGB frames (None when read with decode=False)."""

    @property
    def num_frames(self) -> int:
        return len(self.indices)

    @property
    def effective_fps(self) -> float:
        """Subsampling `total_frames` at `fps` down to `num_frames` lowers the rate proportionally."""
        return self.fps * self.num_frames / self.total_frames if self.total_frames else self.fps

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each kept frame in the source."""
        return [i / self.fps for i in self.indices]


def _frame_refs(item: dict) -> Optional[list]:
    ref = item["video"]
    if isinstance(ref, list):
        return ref
    if isinstance(ref, str) and os.path.isdir(ref):
        frames = sorted(str(p) for p in Path(ref).iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)
        if not frames:
            raise BadRecordError("video", f"no frame images in folder {ref}")
        return frames
    return None  # a video file


def _decode_video_file(path: Any) -> tuple[list[Image.Image], Optional[float]]:
    if isinstance(path, str) and not os.path.isfile(path):
        raise BadRecordError("missing_image", f"video file not found: {path}")
    try:
        from transformers.video_utils import load_video

        frames, metadata = load_video(path)
    except Exception as e:  # no backend installed, unknown codec, corrupt file, ...
        raise BadRecordError("video", f"cannot decode video file {describe(path)} ({type(e).__name__}: {e}); "
                                      "give a list of frame images instead") from None
    fps = float(getattr(metadata, "fps", 0) or 0) or None
    return [Image.fromarray(np.asarray(f)) for f in frames], fps


def read_video(item: dict, max_frames: int, default_fps: float, *, decode: bool = True) -> VideoClip:
    """The kept frames of a video item (module docstring)."""
    refs = _frame_refs(item)
    if refs is None:
        all_frames, file_fps = _decode_video_file(item["video"])
        if not all_frames:
            raise BadRecordError("video", f"{describe(item['video'])}: no frames")
        idx = subsample_indices(len(all_frames), max_frames)
        frames = [all_frames[i].convert("RGB") for i in idx]
        return VideoClip(idx, len(all_frames), float(item.get("fps") or file_fps or default_fps),
                         frames[0].height, frames[0].width, frames if decode else None)
    fps = float(item.get("fps") or default_fps)
    idx = subsample_indices(len(refs), max_frames)
    if not decode:
        h, w = image_hw(refs[idx[0]])
        return VideoClip(idx, len(refs), fps, h, w)
    frames = [load_image(refs[i]) for i in idx]
    sizes = {f.size for f in frames}
    if len(sizes) != 1:
        raise BadRecordError("video", f"frames differ in size {sorted(sizes)} ({describe(refs[0])} ...)")
    return VideoClip(idx, len(refs), fps, frames[0].height, frames[0].width, frames)
