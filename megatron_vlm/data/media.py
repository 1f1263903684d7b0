"""Images and videos of a record: open / decode, sizes from file headers, frame subsampling, limits.

An image reference is a path, bytes, a HF-datasets `{"bytes", "path"}` dict or a PIL image. A video
is a list of frame references, a folder of frames (sorted by name, numbers in names compared as
numbers: 2.png before 10.png) or a video file (path, bytes or
{"bytes", "path"}), read by a `VideoDecoder` (PyAV by default: `pip install av`; tests install a
stand-in with `set_video_decoder`). `read_video` returns a `VideoClip`: the frames kept after
uniform subsampling to `max_frames`, their indices in the source and the source frame rate — what
the processors need for pixels and for timestamps in the text (Qwen3-VL's `<t seconds>`,
Nemotron-VL's "sampled at t seconds"). With `decode=False` nothing is decoded: a video file's
metadata (frame count, rate, size) or a frame list's first header gives the token count. With
`decode=True` only the sampled frames are decoded.

Bad input is refused before it costs memory or time (`MediaLimits`, from `[data]`):
- images / frames whose header declares more than `max_image_pixels` pixels (decompression bombs;
  PIL's own DecompressionBombError lands in the same category) -> "image_too_large";
- videos whose sampled frames x frame pixels exceed `max_video_pixels` -> "video_too_large";
- a video-file decoder call (metadata or frames) that takes longer than `video_decode_timeout_s`
  -> "timeout". The call runs in a daemon thread and the caller stops waiting at the deadline. A
  thread cannot be killed, so a decoder that truly hangs keeps its thread (and its file) until it
  returns; we chose this over a subprocess per video because DataLoader workers are daemonic
  processes (multiprocessing cannot start children there), a fresh interpreter per video costs
  more than most decodes, and frames would have to be copied back between processes. PyAV releases
  the GIL inside FFmpeg, so the worker goes on with its next record. At most
  `MAX_ABANDONED_DECODES` such threads may be alive in one process; beyond that video files are
  refused ("timeout") rather than piling up stuck threads. The DataLoader's own `timeout`
  (`[data] loader_timeout_s`) is the backstop for a worker that is stuck entirely.

Other problems raise `BadRecordError`: missing_image / corrupt_image / video (undecodable, frames
that differ in size or disagree with the metadata).

Every decoded image and frame goes through `to_rgb`, not PIL's bare `convert("RGB")`, which is wrong
for two common kinds of file: it drops the alpha channel, so a transparent PNG (a logo, a diagram,
a screenshot) shows whatever colour its invisible pixels hold, often black on black; and it clips
16-bit grayscale (medical / scientific PNG and TIFF) at 255, so most of such an image turns white.
`to_rgb` composites transparency onto white, as transformers' image processors do
(`image_transforms.convert_to_rgb`), and scales 16-bit samples to 8 bits (v / 257). Before that,
`load_image` turns camera photos upright by their EXIF Orientation tag, as transformers'
`load_image` and vLLM do, and `image_hw` reports the upright size, so planned lengths agree.
"""
from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.config import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_PIXELS,
    DEFAULT_VIDEO_DECODE_TIMEOUT_S,
)

__all__ = [
    "MediaLimits", "DEFAULT_LIMITS", "VideoClip", "VideoInfo", "VideoDecoder", "PyAVDecoder", "set_video_decoder", "video_decoder",
    "load_image", "image_hw", "read_video", "subsample_indices", "describe", "MAX_ABANDONED_DECODES", "to_rgb",
]

_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
MAX_ABANDONED_DECODES = 4
"""Decoder threads past their deadline that may still be running in one process (module docstring)."""


@dataclass(frozen=True)
class MediaLimits:
    """What one record's images and videos may cost (the `[data]` keys of the same names)."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    video_decode_timeout_s: float = DEFAULT_VIDEO_DECODE_TIMEOUT_S

    @classmethod
    def from_config(cls, data_cfg: Any) -> MediaLimits:
        return cls(max_image_pixels=int(data_cfg.max_image_pixels), max_video_pixels=int(data_cfg.max_video_pixels),
                   video_decode_timeout_s=float(data_cfg.video_decode_timeout_s))

    def identity(self) -> dict:
        """What changes which records are usable (for the length cache key); the timeout does not."""
        return {"max_image_pixels": self.max_image_pixels, "max_video_pixels": self.max_video_pixels}


DEFAULT_LIMITS = MediaLimits()


def describe(ref: Any) -> str:
    """A short name of an image / video reference for error messages."""
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, dict):
        return str(ref.get("path") or f"<{len(ref.get('bytes') or b'')} bytes>")
    if isinstance(ref, Image.Image):
        return f"<PIL {ref.size}>"
    return str(ref)


def _check_pixels(ref: Any, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise BadRecordError("image_too_large", f"{describe(ref)}: {width} x {height} = {width * height} pixels "
                                                f"> data.max_image_pixels = {max_pixels} (from the header, not decoded)")


def _not_found(ref: str, what: str) -> str:
    if ref.startswith(("http://", "https://")):
        return f"{ref}: remote URLs are not downloaded (no network access while training); download the files and give local paths"
    return f"{what} not found: {ref}"


def _open(ref: Any, max_pixels: int) -> Image.Image:
    """Open lazily (header only) and check the declared size; raises BadRecordError for missing /
    unreadable files and images over `max_pixels`."""
    if isinstance(ref, Image.Image):
        _check_pixels(ref, *ref.size, max_pixels)
        return ref
    if isinstance(ref, dict):  # HF datasets Image(decode=False): {"bytes": ..., "path": ...}
        ref = ref.get("bytes") or ref.get("path")
    try:
        if isinstance(ref, (bytes, bytearray)):
            img = Image.open(io.BytesIO(ref))
        elif isinstance(ref, str):
            if not os.path.isfile(ref):
                raise BadRecordError("missing_image", _not_found(ref, "file"))
            img = Image.open(ref)
        else:
            raise BadRecordError("invalid_record", f"unsupported image reference {type(ref).__name__}")
    except Image.DecompressionBombError as e:
        raise BadRecordError("image_too_large", f"{describe(ref)}: {e}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadRecordError("corrupt_image", f"{describe(ref)}: {e}") from None
    _check_pixels(ref, *img.size, max_pixels)
    return img


_EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = (5, 6, 7, 8)  # orientations that turn the image by 90 degrees (transpose / rotate)


_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
"""How each EXIF orientation is turned upright (the mapping of Pillow's `ImageOps.exif_transpose`)."""


def _orientation(img: Image.Image) -> int:
    """The EXIF Orientation tag (1 = upright) from the header only; unreadable EXIF counts as upright, as
    vLLM's loader treats it (the pixels are still usable). A PNG's EXIF is read only from an eXIf chunk before
    its pixels (where writers put it): for a PNG without one, Pillow's `getexif` decodes the whole image to look
    behind the pixels, which made length planning decode every PNG (85 ms for 1920x1080 instead of 0.07 ms)."""
    if img.format == "PNG" and "exif" not in img.info:
        return 1
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
        return int(value) if 1 <= int(value) <= 8 else 1
    except Exception:  # malformed EXIF block: keep the stored orientation
        return 1


def image_hw(ref: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(height, width) of the image as displayed (EXIF orientation applied, see `load_image`) from
    the file header, without decoding pixels; over `max_pixels` is a bad record."""
    img = _open(ref, max_pixels)
    w, h = img.size
    return (w, h) if _orientation(img) in _SWAPS_SIDES else (h, w)


_WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` as 8-bit RGB (module docstring): transparency composited onto white; 16-bit samples
    ("I;16*" modes) scaled by 1 / 257. 32-bit "I" and float "F" images are scaled the same way when
    their values exceed 255 (they hold 16-bit data: older Pillow opens 16-bit PNGs as "I"), else
    taken as 8-bit values."""
    if img.mode == "RGB":
        return img
    if img.mode in _WIDE_GRAY_MODES:
        a = np.asarray(img, dtype=np.float64)
        if img.mode.startswith("I;16") or (a.size and a.max() > 255):
            a = np.clip(a, 0, 65535) / 257.0
        img = Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8), mode="L")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(ref: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode fully to RGB (`to_rgb`) once the header passed the pixel cap, upright: the EXIF
    Orientation tag of a camera photo is applied (as `ImageOps.exif_transpose` does), as transformers'
    `load_image` and vLLM do, so the model sees what a viewer shows, not the sensor's sideways
    pixels. Truncated or corrupt data raises BadRecordError("corrupt_image")."""
    img = _open(ref, max_pixels)
    try:
        orientation = _orientation(img)  # from the header, before decoding: the one `image_hw` planned with
        img.load()
        if orientation in _TRANSPOSE:
            img = img.transpose(_TRANSPOSE[orientation])
        return to_rgb(img)
    except Image.DecompressionBombError as e:
        raise BadRecordError("image_too_large", f"{describe(ref)}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
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


# ---------------------------------------------------------------------- video files
@dataclass(frozen=True)
class VideoInfo:
    """A video file's metadata, read without decoding frames."""

    num_frames: int
    fps: Optional[float]
    """Frames per second of the stream; None when the container does not say."""
    height: int
    width: int


class VideoDecoder(Protocol):
    """Reads video files. `src` is a path or a binary file object (fresh for each call)."""

    def probe(self, src: Any) -> VideoInfo:
        """Frame count, rate and frame size from the container, without decoding frames."""

    def decode(self, src: Any, indices: Sequence[int]) -> list:
        """The frames at `indices` (ascending), as PIL images or HxWx3 uint8 arrays; decoding stops
        after the last one."""


class PyAVDecoder:
    """`VideoDecoder` on PyAV (FFmpeg). The frame count is the stream's when the container stores
    one, else the number of its packets (demuxed, not decoded)."""

    @staticmethod
    def _av():
        try:
            import av
        except ImportError as e:
            raise BadRecordError("video", "reading video files needs PyAV (pip install av); "
                                          "or give a list of frame images instead") from e
        return av

    def probe(self, src: Any) -> VideoInfo:
        av = self._av()
        with av.open(src) as container:
            if not container.streams.video:
                raise BadRecordError("video", "the file has no video stream")
            stream = container.streams.video[0]
            n = int(stream.frames or 0)
            if n <= 0:
                n = sum(1 for packet in container.demux(stream) if packet.size)
            rate = stream.average_rate or stream.guessed_rate
            return VideoInfo(n, float(rate) if rate else None, int(stream.codec_context.height),
                             int(stream.codec_context.width))

    def decode(self, src: Any, indices: Sequence[int]) -> list:
        av = self._av()
        wanted, last, out = set(indices), max(indices), {}
        with av.open(src) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    out[i] = frame.to_image()
                if i >= last:
                    break
        return [out[i] for i in indices if i in out]


_decoder: VideoDecoder = PyAVDecoder()
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def set_video_decoder(decoder: VideoDecoder) -> VideoDecoder:
    """Use `decoder` for video files in this process and in the DataLoader workers it starts later (they get it
    pickled, loader.py); returns the previous one."""
    global _decoder
    previous, _decoder = _decoder, decoder
    return previous


def video_decoder() -> VideoDecoder:
    """The decoder `set_video_decoder` set (PyAV's by default)."""
    return _decoder


def _with_deadline(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """`fn()` in a daemon thread; BadRecordError("timeout") if it has not returned after `timeout_s`
    (the thread is left to finish on its own, see module docstring)."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        if len(_abandoned) >= MAX_ABANDONED_DECODES:
            raise BadRecordError("timeout", f"{what}: not started, {len(_abandoned)} earlier video decodes of this "
                                            "process are still hanging past data.video_decode_timeout_s")
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="megatron-vlm-video-decode", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _abandoned_lock:
            _abandoned.append(thread)
        raise BadRecordError("timeout", f"{what}: no result within data.video_decode_timeout_s = {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _video_opener(ref: Any) -> Callable[[], Any]:
    """A function giving a fresh source for the decoder (a path, or a file object over the bytes)."""
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, os.PathLike):
        ref = os.fspath(ref)
    if isinstance(ref, (bytes, bytearray)):
        data = bytes(ref)
        return lambda: io.BytesIO(data)
    if isinstance(ref, str):
        if not os.path.isfile(ref):
            raise BadRecordError("missing_image", _not_found(ref, "video file"))
        return lambda: ref
    raise BadRecordError("invalid_record", f"unsupported video reference {type(ref).__name__}")


def _decoder_call(fn: Callable[[], Any], ref: Any, limits: MediaLimits, what: str) -> Any:
    try:
        return _with_deadline(fn, limits.video_decode_timeout_s, f"{what} {describe(ref)}")
    except BadRecordError:
        raise
    except Exception as e:  # unknown codec, corrupt container, ...: the decoder's own exceptions
        raise BadRecordError("video", f"cannot read video file {describe(ref)} ({type(e).__name__}: {e}); "
                                      "give a list of frame images instead") from None


def _check_video_pixels(ref: Any, n: int, height: int, width: int, limits: MediaLimits) -> None:
    _check_pixels(ref, width, height, limits.max_image_pixels)
    if n * height * width > limits.max_video_pixels:
        raise BadRecordError("video_too_large", f"{describe(ref)}: {n} frames x {width} x {height} = "
                                                f"{n * height * width} pixels > data.max_video_pixels = "
                                                f"{limits.max_video_pixels}")


def _read_video_file(item: dict, max_frames: int, default_fps: float, decode: bool, limits: MediaLimits) -> VideoClip:
    ref = item["video"]
    opener = _video_opener(ref)
    decoder = _decoder
    info = _decoder_call(lambda: decoder.probe(opener()), ref, limits, "reading the metadata of")
    if info.num_frames <= 0 or info.height <= 0 or info.width <= 0:
        raise BadRecordError("video", f"{describe(ref)}: no frames ({info})")
    idx = subsample_indices(info.num_frames, max_frames)
    _check_video_pixels(ref, len(idx), info.height, info.width, limits)
    fps = float(item.get("fps") or info.fps or default_fps)
    if not decode:
        return VideoClip(idx, info.num_frames, fps, info.height, info.width)
    raw = _decoder_call(lambda: decoder.decode(opener(), idx), ref, limits, "decoding")
    if len(raw) != len(idx):
        raise BadRecordError("video", f"{describe(ref)}: decoded {len(raw)} of the {len(idx)} sampled frames "
                                      f"(the metadata says {info.num_frames} frames)")
    frames = [to_rgb(f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f))) for f in raw]
    sizes = {f.size for f in frames}
    if sizes != {(info.width, info.height)}:
        raise BadRecordError("video", f"{describe(ref)}: decoded frame sizes {sorted(sizes)} differ from the "
                                      f"metadata's {info.width} x {info.height}")
    return VideoClip(idx, info.num_frames, fps, info.height, info.width, frames)


def _frame_order(path: str) -> list:
    """Sort key of a frame file: its name with digit runs compared as numbers, so frames written without
    zero padding (1.png, 2.png, ..., 10.png, as ffmpeg's %d.png writes them) keep their order."""
    return [(0, int(part), part) if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", Path(path).name)]


def _frame_refs(item: dict) -> Optional[list]:
    ref = item["video"]
    if isinstance(ref, list):
        return ref
    if isinstance(ref, str) and os.path.isdir(ref):
        frames = sorted((str(p) for p in Path(ref).iterdir() if p.suffix.lower() in _FRAME_SUFFIXES), key=_frame_order)
        if not frames:
            raise BadRecordError("video", f"no frame images in folder {ref}")
        return frames
    return None  # a video file


def read_video(item: dict, max_frames: int, default_fps: float, *, decode: bool = True,
               limits: MediaLimits = DEFAULT_LIMITS) -> VideoClip:
    """The kept frames of a video item (module docstring); only those are decoded, and nothing with
    decode=False."""
    refs = _frame_refs(item)
    if refs is None:
        return _read_video_file(item, max_frames, default_fps, decode, limits)
    fps = float(item.get("fps") or default_fps)
    idx = subsample_indices(len(refs), max_frames)
    h, w = image_hw(refs[idx[0]], limits.max_image_pixels)
    _check_video_pixels(refs[idx[0]], len(idx), h, w, limits)
    if not decode:
        return VideoClip(idx, len(refs), fps, h, w)
    frames = [load_image(refs[i], limits.max_image_pixels) for i in idx]
    sizes = {f.size for f in frames}
    if len(sizes) != 1:
        raise BadRecordError("video", f"frames differ in size {sorted(sizes)} ({describe(refs[0])} ...)")
    return VideoClip(idx, len(refs), fps, frames[0].height, frames[0].width, frames)
