"""The dataset's media limits on what an environment shows: frames subsampled, too-large images refused.

Why here, in the environment's worker: an observation's images and frames are already decoded (a tool returns PIL
images or arrays), so the checks the data pipeline makes on a file's header (data/media.py) are made on their sizes,
before the reply is pickled back to the trainer: a huge image or a long frame list would otherwise cross the
process boundary and go through the processor before the token budget refuses the turn. Each limit does what the
same `[data]` key does to a record (data/media.py `read_video`):

- `max_frames`: a video with more frames is uniformly subsampled to this many (`subsample_indices`); it travels as
  a `VideoClip` of the kept frames with their indices in the source, so its timestamps and effective frame rate are
  a record's (the source's rate is the observation's `video_fps`);
- `max_image_pixels`: an image or frame of more pixels is refused (a record's is a bad record, "image_too_large");
- `max_video_pixels`: a video whose kept frames x frame pixels exceed it is refused ("video_too_large").

A refusal is a ValueError naming the key: the worker's call fails and the trajectory ends as env_error (counted).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_vlm.data.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS, DataConfig
from megatron_vlm.data.media import VideoClip, subsample_indices
from megatron_vlm.rl.env.base import Observation

__all__ = ["ObservationLimits", "limit_observation"]


@dataclass(frozen=True)
class ObservationLimits:
    """The `[data]` keys of the same names (defaults: theirs)."""

    max_frames: int = DataConfig.max_frames
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS

    @classmethod
    def from_data(cls, data_cfg: Any) -> ObservationLimits:
        return cls(max_frames=int(data_cfg.max_frames), max_image_pixels=int(data_cfg.max_image_pixels),
                   max_video_pixels=int(data_cfg.max_video_pixels))


def _hw(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or an H x W x C array; (0, 0) for anything else (the encoder refuses it)."""
    if type(image).__module__.startswith("PIL."):
        w, h = image.size
        return int(h), int(w)
    shape = getattr(image, "shape", None)
    return (int(shape[0]), int(shape[1])) if shape is not None and len(shape) >= 2 else (0, 0)


def _check_image(what: str, image: Any, limits: ObservationLimits) -> None:
    h, w = _hw(image)
    if h * w > limits.max_image_pixels:
        raise ValueError(f"{what} of {w} x {h} = {h * w} pixels > data.max_image_pixels = {limits.max_image_pixels}")


def _limited_video(i: int, frames: Any, fps: float, limits: ObservationLimits) -> Any:
    """Video `i` with at most `max_frames` frames (a `VideoClip` when subsampled), its sizes checked."""
    n = len(frames)
    idx = subsample_indices(n, limits.max_frames)
    kept = [frames[j] for j in idx]
    for j, frame in zip(idx, kept):
        _check_image(f"video {i} frame {j}", frame, limits)
    pixels = sum(h * w for h, w in map(_hw, kept))
    if pixels > limits.max_video_pixels:
        raise ValueError(f"video {i}: {len(kept)} frames of {pixels} pixels in all > data.max_video_pixels = "
                         f"{limits.max_video_pixels}")
    if len(idx) == n:
        return frames
    h, w = _hw(kept[0]) if kept else (0, 0)
    return VideoClip(indices=idx, total_frames=n, fps=float(fps), height=h, width=w, frames=kept)


def limit_observation(obs: Observation, limits: ObservationLimits) -> Observation:
    """`obs` within `limits` (module docstring): its videos subsampled, or a ValueError naming the key it exceeds."""
    for i, image in enumerate(obs.images):
        _check_image(f"image {i}", image, limits)
    videos = [_limited_video(i, v, obs.video_fps, limits) for i, v in enumerate(obs.videos)]
    if all(a is b for a, b in zip(videos, obs.videos)):
        return obs
    return dataclasses.replace(obs, videos=videos)
