"""One record -> model inputs: chat template, images / videos, placeholder expansion, labels mask.

`process_record` does what `Qwen2_5_VLProcessor(text=apply_chat_template(messages), images=...,
videos=...)` does — render the conversation with the model folder's chat template, preprocess the
images (and frame-list videos), expand each `<|image_pad|>` / `<|video_pad|>` to its number of
merged patches, tokenise — and adds the labels mask: True exactly on the tokens of every assistant
turn's content plus the `<|im_end|>` that closes it (the header `<|im_start|>assistant\\n` and the
newline after `<|im_end|>` are not trained). The mask is found on character offsets of the rendered
text, so it holds for any tokenizer.

`estimate_length` gives the exact token count without decoding pixels (image sizes come from file
headers, the resize rule from the processor), so packs can be planned for a whole epoch cheaply.

Per-record problems raise `BadRecordError` (missing / corrupt image, undecodable video, a
placeholder count that does not match the images or the features).
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.messages import Record
from megatron_vlm.data.processor import VLProcessor

__all__ = [
    "ProcessedSample", "process_record", "estimate_length", "assistant_char_spans", "prompt_messages",
    "load_image", "image_hw", "video_frames", "video_shape", "subsample_indices",
]

_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


@dataclass
class ProcessedSample:
    input_ids: torch.Tensor
    """[T] int64 token ids (placeholders expanded)."""
    label_mask: torch.Tensor
    """[T] bool: True on trained assistant tokens (not yet shifted)."""
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None
    second_per_grid_ts: Optional[torch.Tensor] = None
    source: str = ""
    index: int = -1
    answer: Optional[str] = None
    """For generation prompts: the reference answer (the dropped last assistant turn)."""
    meta: dict = field(default_factory=dict)
    """The record's other top-level fields (e.g. "question_type")."""

    def __len__(self) -> int:
        return int(self.input_ids.numel())


# ---------------------------------------------------------------------- media
def _describe(ref: Any) -> str:
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
        raise BadRecordError("corrupt_image", f"{_describe(ref)}: {e}") from None
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
        raise BadRecordError("corrupt_image", f"{_describe(ref)}: {e}") from None


def subsample_indices(n: int, max_frames: int) -> list[int]:
    """Uniformly spread `min(n, max_frames)` indices over n frames (first and last included)."""
    if n <= max_frames:
        return list(range(n))
    return [int(round(x)) for x in np.linspace(0, n - 1, max_frames)]


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


def _decode_video_file(path: Any) -> tuple[list[Image.Image], float]:
    if isinstance(path, str) and not os.path.isfile(path):
        raise BadRecordError("missing_image", f"video file not found: {path}")
    try:
        from transformers.video_utils import load_video

        frames, metadata = load_video(path)
    except Exception as e:  # no backend installed, unknown codec, corrupt file, ...
        raise BadRecordError("video", f"cannot decode video file {_describe(path)} ({type(e).__name__}: {e}); "
                                      "give a list of frame images instead") from None
    fps = float(getattr(metadata, "fps", 0) or 0) or None
    return [Image.fromarray(np.asarray(f)) for f in frames], fps


def video_frames(item: dict, max_frames: int, default_fps: float) -> tuple[list[Image.Image], float]:
    """Decoded RGB frames after subsampling to at most max_frames, and their effective fps."""
    refs = _frame_refs(item)
    fps = item.get("fps")
    if refs is None:
        all_frames, file_fps = _decode_video_file(item["video"])
        fps = fps or file_fps or default_fps
        idx = subsample_indices(len(all_frames), max_frames)
        return [all_frames[i].convert("RGB") for i in idx], _effective_fps(fps, len(idx), len(all_frames))
    fps = fps or default_fps
    idx = subsample_indices(len(refs), max_frames)
    frames = [load_image(refs[i]) for i in idx]
    sizes = {f.size for f in frames}
    if len(sizes) != 1:
        raise BadRecordError("video", f"frames differ in size {sorted(sizes)} ({_describe(refs[0])} ...)")
    return frames, _effective_fps(fps, len(idx), len(refs))


def _effective_fps(fps: float, kept: int, total: int) -> float:
    """Subsampling `total` frames at `fps` down to `kept` lowers the frame rate proportionally."""
    return float(fps) * kept / total if total else float(fps)


def video_shape(item: dict, max_frames: int) -> tuple[int, int, int]:
    """(frames after subsampling, height, width) from the first frame's header (video files: decoded)."""
    refs = _frame_refs(item)
    if refs is None:
        frames, _ = _decode_video_file(item["video"])
        return len(subsample_indices(len(frames), max_frames)), frames[0].height, frames[0].width
    h, w = image_hw(refs[0])
    return len(subsample_indices(len(refs), max_frames)), h, w


# ---------------------------------------------------------------------- text
def _check_text(record_messages: list[dict], proc: VLProcessor) -> None:
    """User text must not contain the processor's special tokens (they would spoof placeholders / turns)."""
    for i, m in enumerate(record_messages):
        texts = [m["content"]] if isinstance(m["content"], str) else [
            it["text"] for it in m["content"] if it["type"] == "text"]
        for t in texts:
            for s in (proc.image_token, proc.video_token):
                if s in t:
                    raise BadRecordError("placeholder_mismatch", f"messages[{i}] text contains the placeholder {s}")
            for s in proc.special_strings:
                if s in t:
                    raise BadRecordError("invalid_record", f"messages[{i}] text contains the special token {s}")


def assistant_char_spans(text: str, proc: VLProcessor) -> list[tuple[int, int]]:
    """[start, end) character spans of assistant content + the closing turn-end token."""
    spans, pos = [], 0
    while True:
        i = text.find(proc.assistant_header, pos)
        if i < 0:
            return spans
        start = i + len(proc.assistant_header)
        j = text.find(proc.turn_end, start)
        end = len(text) if j < 0 else j + len(proc.turn_end)
        spans.append((start, end))
        pos = end


def prompt_messages(messages: list[dict]) -> tuple[list[dict], str]:
    """Messages before the last assistant turn, and that turn's text (the reference answer)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def _expand(text: str, token: str, counts: list[int]) -> str:
    parts = text.split(token)
    if len(parts) - 1 != len(counts):
        raise BadRecordError("placeholder_mismatch",
                             f"{len(parts) - 1} {token} placeholders in the text but {len(counts)} inputs")
    out = [parts[0]]
    for n, part in zip(counts, parts[1:]):
        out.append(token * n)
        out.append(part)
    return "".join(out)


def _tokenize(proc: VLProcessor, text: str, offsets: bool):
    return proc.tokenizer(text, return_offsets_mapping=offsets)


def estimate_length(record: Record, proc: VLProcessor, *, max_frames: int, for_generation: bool = False) -> int:
    """Exact token count of `process_record(record, ...)` from image headers only (no pixel decoding)."""
    messages = record.messages
    gen = False
    if for_generation:
        messages, _ = prompt_messages(messages)
        gen = True
    _check_text(messages, proc)
    text = proc.render(messages, add_generation_prompt=gen)
    n = len(_tokenize(proc, text, offsets=False)["input_ids"])
    images = [it["image"] for m in messages if not isinstance(m["content"], str)
              for it in m["content"] if it["type"] == "image"]
    videos = [it for m in messages if not isinstance(m["content"], str) for it in m["content"] if it["type"] == "video"]
    if text.count(proc.image_token) != len(images) or text.count(proc.video_token) != len(videos):
        raise BadRecordError("placeholder_mismatch", f"the chat template produced {text.count(proc.image_token)} "
                             f"image / {text.count(proc.video_token)} video placeholders for {len(images)} images / "
                             f"{len(videos)} videos")
    for ref in images:
        n += proc.num_tokens(proc.image_grid_thw(*image_hw(ref))) - 1
    for item in videos:
        n += proc.num_tokens(proc.video_grid_thw(*video_shape(item, max_frames))) - 1
    return n


def process_record(record: Record, proc: VLProcessor, *, max_frames: int, fps: float = 2.0,
                   for_generation: bool = False) -> ProcessedSample:
    """Tokens, labels mask and vision tensors of one record (see module docstring).

    for_generation: drop the last assistant turn, end with the generation prompt, no labels; the
    dropped text is returned as `answer`."""
    messages, answer = record.messages, None
    if for_generation:
        messages, answer = prompt_messages(messages)
    _check_text(messages, proc)
    text = proc.render(messages, add_generation_prompt=for_generation)
    images = [it["image"] for m in messages if not isinstance(m["content"], str)
              for it in m["content"] if it["type"] == "image"]
    videos = [it for m in messages if not isinstance(m["content"], str) for it in m["content"] if it["type"] == "video"]
    out = ProcessedSample(input_ids=torch.empty(0, dtype=torch.long), label_mask=torch.empty(0, dtype=torch.bool),
                          source=record.source, index=record.index, answer=answer,
                          meta=record.meta)
    image_counts: list[int] = []
    if images:
        vis = proc.preprocess_images([load_image(ref) for ref in images])
        out.pixel_values, out.image_grid_thw = vis["pixel_values"], vis["image_grid_thw"]
        image_counts = [proc.num_tokens(g) for g in out.image_grid_thw]
    video_counts: list[int] = []
    if videos:
        parts = []
        for item in videos:
            frames, eff_fps = video_frames(item, max_frames, fps)
            parts.append(proc.preprocess_video(frames, eff_fps))
        out.pixel_values_videos = torch.cat([p["pixel_values_videos"] for p in parts])
        out.video_grid_thw = torch.cat([p["video_grid_thw"] for p in parts])
        out.second_per_grid_ts = torch.cat([p["second_per_grid_ts"] for p in parts])
        video_counts = [proc.num_tokens(g) for g in out.video_grid_thw]
    text = _expand(text, proc.image_token, image_counts)
    text = _expand(text, proc.video_token, video_counts)
    enc = _tokenize(proc, text, offsets=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    n_img, n_vid = int((ids == proc.image_token_id).sum()), int((ids == proc.video_token_id).sum())
    if n_img != sum(image_counts) or n_vid != sum(video_counts):
        raise BadRecordError("placeholder_mismatch", f"{n_img} image tokens vs {sum(image_counts)} image features, "
                                                     f"{n_vid} video tokens vs {sum(video_counts)} video features")
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    if not for_generation:
        spans = assistant_char_spans(text, proc)
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        if len(spans) != n_assistant:
            raise BadRecordError("invalid_record", f"found {len(spans)} assistant turns in the rendered text, "
                                                   f"expected {n_assistant} (chat template / turn markers)")
        starts = torch.tensor([s for s, _ in enc["offset_mapping"]], dtype=torch.long)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
    out.input_ids, out.label_mask = ids, mask
    return out
