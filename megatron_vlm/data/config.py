"""The `[data]` config section: where the training / evaluation data lives and how it is packed.

A kw_only dataclass like every config section (so the strict TOML loader can check every key); the
string under each field documents it and feeds the README's config reference. `validate()` raises ValueError("<field>: ...") and the strict
loader prefixes `data.`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

__all__ = ["DataConfig"]


@dataclass(kw_only=True)
class DataConfig:
    type: Literal["messages_jsonl", "hf", "synthetic_vqa"] = "messages_jsonl"
    """Source kind: "messages_jsonl" (one {"messages": [...]} record per line, see data/messages.py),
    "hf" (a Hugging Face `datasets` table from local parquet / arrow / jsonl files, mapped by
    `columns`) or "synthetic_vqa" (the shapes-and-colours VQA set, generated into `synthetic_dir`)."""
    train_path: str = ""
    """Training data: a file, a folder (searched recursively) or a glob of .jsonl files
    (messages_jsonl) or of .parquet, .arrow and .jsonl files (hf); SFT and GRPO read it alike.
    Unused for synthetic_vqa."""
    eval_path: str = ""
    """Held-out data in the same format as `train_path`; empty = no evaluation split."""
    image_root: str = ""
    """Folder that relative image / video paths resolve against; empty = the data file's folder."""
    columns: dict[str, str] = field(default_factory=dict)
    """hf only: our field -> dataset column. Either {"messages": col} (+ optional "images": col whose
    list fills the messages' image entries in order), or {"prompt": col, "answer": col} with optional
    "image" / "images", "video", "system" columns (a one-turn conversation is built from them)."""
    min_pixels: Optional[int] = None
    """Smallest resized image area in pixels; unset = the model folder's preprocessor config."""
    max_pixels: Optional[int] = None
    """Largest resized image area in pixels; unset = the model folder's preprocessor config."""
    video_min_pixels: Optional[int] = None
    """Smallest resized video-frame area; unset = the model folder's video preprocessor config."""
    video_max_pixels: Optional[int] = None
    """Largest resized video-frame area; unset = the model folder's video preprocessor config."""
    max_frames: int = 16
    """Videos with more frames are uniformly subsampled to this many."""
    fps: float = 2.0
    """Frame rate of frame lists whose record gives none (sets second_per_grid_ts for M-RoPE)."""
    max_tokens_per_pack: int = 4096
    """Token budget of one packed micro-batch; longer samples are skipped as bad records."""
    num_workers: int = 2
    """DataLoader worker processes that tokenise, load images and pack (0 = in the main process)."""
    prefetch_factor: int = 2
    """Packs each worker prepares ahead (ignored when num_workers = 0)."""
    shuffle: bool = True
    """Reshuffle the training samples every epoch (deterministic from train.seed + epoch)."""
    length_cache_dir: str = ""
    """Folder for the per-sample token-length cache used to plan packs; empty = in memory only."""
    synthetic_dir: str = ""
    """synthetic_vqa only: folder to write the generated set into (the trainer sets it to
    <run>/data when empty)."""
    synthetic_train_size: int = 512
    """synthetic_vqa only: number of training samples."""
    synthetic_eval_size: int = 64
    """synthetic_vqa only: number of held-out samples."""
    synthetic_seed: int = 0
    """synthetic_vqa only: generator seed (the set is a pure function of it and the sizes)."""
    synthetic_image_size: int = 56
    """synthetic_vqa only: side of the square canvas in pixels (a multiple of 28)."""

    def validate(self) -> None:
        if self.type in ("messages_jsonl", "hf") and not self.train_path:
            raise ValueError(f"train_path: required when type = {self.type!r}")
        if self.type == "hf" and not self.columns:
            raise ValueError("columns: required when type = 'hf' (e.g. {messages = \"conversations\"})")
        if self.type == "hf":
            keys = set(self.columns)
            if "messages" not in keys and not {"prompt", "answer"} <= keys:
                raise ValueError(f"columns: needs 'messages' or both 'prompt' and 'answer', got {sorted(keys)}")
            allowed = {"messages", "images", "image", "video", "prompt", "answer", "system"}
            unknown = sorted(keys - allowed)
            if unknown:
                raise ValueError(f"columns: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")
        for name in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels: {self.min_pixels} is larger than max_pixels {self.max_pixels}")
        if self.video_min_pixels and self.video_max_pixels and self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"video_min_pixels: {self.video_min_pixels} is larger than video_max_pixels {self.video_max_pixels}")
        if self.max_frames <= 0:
            raise ValueError(f"max_frames: must be > 0, got {self.max_frames}")
        if self.fps <= 0:
            raise ValueError(f"fps: must be > 0, got {self.fps}")
        if self.max_tokens_per_pack < 16:
            raise ValueError(f"max_tokens_per_pack: must be >= 16, got {self.max_tokens_per_pack}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers: must be >= 0, got {self.num_workers}")
        if self.prefetch_factor <= 0:
            raise ValueError(f"prefetch_factor: must be > 0, got {self.prefetch_factor}")
        if self.synthetic_train_size <= 0:
            raise ValueError(f"synthetic_train_size: must be > 0, got {self.synthetic_train_size}")
        if self.synthetic_eval_size < 0:
            raise ValueError(f"synthetic_eval_size: must be >= 0, got {self.synthetic_eval_size}")
        if self.synthetic_image_size < 28 or self.synthetic_image_size % 28:
            raise ValueError(f"synthetic_image_size: must be a positive multiple of 28, got {self.synthetic_image_size}")
