"""The `[data]` config section: where the training / evaluation data lives and how it is packed.

A kw_only dataclass like every config section (so the strict TOML loader can check every key); the
string under each field documents it and feeds the README's config reference. `validate()` raises ValueError("<field>: ...") and the strict
loader prefixes `data.`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from megatron_vlm.table_checks import above, at_least

__all__ = ["DataConfig", "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_MAX_VIDEO_PIXELS", "DEFAULT_VIDEO_DECODE_TIMEOUT_S"]

DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
"""67,108,864 pixels: more than any real photo or scan, below PIL's own bomb limits (warning at
89,478,485, refusal at twice that), about 200 MB once decoded to RGB."""
DEFAULT_MAX_VIDEO_PIXELS = 16 * 3840 * 2160
"""132,710,400 pixels: sixteen 4K frames, about 400 MB once decoded to RGB."""
DEFAULT_VIDEO_DECODE_TIMEOUT_S = 60.0
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "chat_template", "return_dict",
                                      "return_assistant_tokens_mask"})
"""Arguments of `apply_chat_template` the pipeline passes itself (not `data.chat_template_kwargs`)."""


@dataclass(kw_only=True)
class DataConfig:
    # filesystem paths: a leading ~ is expanded (config/loader.py)
    PATHS: ClassVar[tuple[str, ...]] = ("train_path", "eval_path", "image_root", "length_cache_dir", "synthetic_dir")
    type: Literal["messages_jsonl", "hf", "synthetic_vqa"] = "messages_jsonl"
    """Source kind: "messages_jsonl" (one {"messages": [...]} record per line, see data/messages.py, or a
    LLaVA / ShareGPT {"conversations": [...]} record; a file may also be one JSON array of records),
    "hf" (a Hugging Face `datasets` table from local parquet / arrow / jsonl files, mapped by
    `columns`) or "synthetic_vqa" (the shapes-and-colours VQA set, generated into `synthetic_dir`)."""
    train_path: str = ""
    """Training data: a file, a folder (searched recursively; hidden files and folders such as .ipynb_checkpoints,
    and __pycache__, left out as Hugging Face `datasets` leaves them) or a glob of .jsonl and .json files
    (messages_jsonl) or of .parquet, .arrow, .jsonl and .json files (hf); SFT and GRPO read it alike. A
    .json file is JSON lines, one JSON array of records (LLaVA's) or one record object (pretty-printed or
    not); in a folder or glob, .json files that are neither (save_to_disk's dataset_info.json / state.json / dataset_dict.json, a config.json) or whose
    first object has none of the record columns ("messages" / "conversations", the mapped `columns`: a
    one-line {"version": 2}) are skipped and counted in the log; a .jsonl file is always data. A file named
    directly is read whatever its suffix. A glob such as "data/**/*.jsonl" leaves the .json files out.
    Refused with synthetic_vqa, as are eval_path, image_root and columns (it reads the set it generates)."""
    eval_path: str = ""
    """Held-out data in the same format as `train_path`; empty = no evaluation split."""
    image_root: str = ""
    """Folder that relative image / video paths resolve against; empty = the data file's folder."""
    columns: dict[str, str] = field(default_factory=dict)
    """hf only: our field -> dataset column. Either {"messages": col} (+ optional "image" / "images": col whose
    values fill the messages' image entries in order, "video": col, one video (a file, or a list of frames) for the
    messages' "<video>" marker or video entry without data, "system": col for rows without a system turn; a column of
    LLaVA / ShareGPT {"from", "value"} turns takes the "image" / "images" columns at its "<image>" markers, the "video"
    column at its "<video>" marker (LLaVA-Video-178K's "<image>" marker when the row has a video and no image) and an
    optional "system" column), or {"prompt": col, "answer": col} with optional
    "image" / "images", "video", "system" columns (a one-turn conversation is built from them; a prompt cell that is
    a list of messages is TRL's conversational prompt-completion: its turns, then the answer cell's string or one
    assistant message); for
    train.mode = "dpo" {"chosen": col, "rejected": col} with optional "prompt", "image" / "images" and
    "system" (TRL's preference layouts, data/preference_records.py). Required with type = "hf", except
    for GRPO: left out there, the prompt table's layout is detected from its column names (verl's
    preprocessed parquet, TRL GRPO datasets, Geometry3K, ViRL39K, messages; docs/migrating.md)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the model's chat template, as transformers' `apply_chat_template(**kwargs)` takes them
    (verl's apply_chat_template_kwargs; e.g. `{ enable_thinking = false }` for Qwen3's template): every
    rendering of the run uses them (training samples, GRPO prompts and multi-turn replies, DPO pairs, evaluation).
    A name the template never reads exits 2 (it would do nothing), as do the names the pipeline sets itself."""
    min_pixels: Optional[int] = None
    """Smallest resized image area in pixels; unset = the model folder's preprocessor config."""
    max_pixels: Optional[int] = None
    """Largest resized image area in pixels; unset = the model folder's preprocessor config."""
    video_min_pixels: Optional[int] = None
    """Smallest resized video-frame area (Qwen3-VL: of the whole clip, frames x area, as its video processor's
    size bounds it); unset = the model folder's video preprocessor config (without one, its image config, as
    transformers reads it). The Hugging Face export writes it into its video processor config."""
    video_max_pixels: Optional[int] = None
    """Largest resized video-frame area (Qwen3-VL: of the whole clip, frames x area, as its video processor's
    size bounds it); unset = the model folder's video preprocessor config."""
    max_frames: int = 16
    """Videos with more frames are uniformly subsampled to this many."""
    fps: float = 2.0
    """Frame rate of frame lists whose record gives none (sets second_per_grid_ts for M-RoPE)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image (or video frame) area in pixels, width x height as declared by the file header;
    larger ones are skipped as bad records ("image_too_large") before any pixel is decoded, so a
    decompression bomb (a few KB of PNG declaring 20000 x 20000 pixels) cannot exhaust a worker's
    memory. Default 67,108,864 (8192 x 8192). PIL refuses images above 2 x PIL.Image.MAX_IMAGE_PIXELS
    (178,956,970 by default) on its own; those are counted in the same category."""
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    """Largest decoded size of one video in pixels: sampled frames (at most `max_frames`) x frame
    width x height, from the container's metadata or the first frame's header before decoding;
    larger videos are skipped as bad records ("video_too_large"). Default 132,710,400 (sixteen 4K
    frames, about 400 MB as RGB)."""
    video_decode_timeout_s: float = DEFAULT_VIDEO_DECODE_TIMEOUT_S
    """Seconds one video-file decoder call (reading the metadata, or decoding the sampled frames) may
    take; a decoder that hangs on a broken file turns the record into a bad record ("timeout")
    instead of stalling a DataLoader worker. Default 60. The call runs in a daemon thread that is
    abandoned, not killed, when the deadline passes (see data/media.py)."""
    loader_timeout_s: float = 1800.0
    """Seconds the training process waits for the next pack from a DataLoader worker
    (torch DataLoader `timeout`, num_workers > 0 only) before failing with an error instead of
    hanging forever on a stuck worker. Must be at least `video_decode_timeout_s` (a pack may hold
    several videos); 0 = wait forever. Default 1800. Refused where no DataLoader worker runs (num_workers = 0,
    and GRPO, which reads its prompts in the training process)."""
    max_tokens_per_pack: int = 4096
    """Token budget of one packed micro-batch; longer samples are skipped as bad records."""
    num_workers: int = 2
    """DataLoader worker processes that tokenise, load images and pack (0 = in the main process); also the
    processes that compute the planning lengths at start-up (rendering, tokenising and reading the image
    header of every record; 0 = in the main process)."""
    prefetch_factor: int = 2
    """Packs each worker prepares ahead. Refused with num_workers = 0 (no worker; `--set data.num_workers=0` drops the
    file's value)."""
    shuffle: bool = True
    """Reshuffle the training samples every epoch (deterministic from train.seed + epoch)."""
    length_cache_dir: str = ""
    """Folder for the per-sample token-length cache used to plan packs; empty = in memory only."""
    synthetic_dir: str = ""
    """synthetic_vqa only (the synthetic_* keys are refused with another type; `--set data.type=...` drops the
    file's): folder to write the generated set into (the trainer sets it to <run>/data when empty)."""
    synthetic_train_size: int = 512
    """synthetic_vqa only: number of training samples."""
    synthetic_eval_size: int = 64
    """synthetic_vqa only: number of held-out samples."""
    synthetic_seed: int = 0
    """synthetic_vqa only: generator seed (the set is a pure function of it and the sizes)."""
    synthetic_image_size: int = 56
    """synthetic_vqa only: side of the square canvas in pixels (a multiple of 28)."""

    def validate(self) -> None:
        # train_path is required by the training modes only (config.Config.validate): an evaluation
        # job reads its benchmarks from [eval] and may leave [data] out.
        # an empty `columns` with type "hf" is refused by the top-level config for every mode but GRPO, which
        # detects the prompt table's layout (rl/prompts/dataset.py); only the mode knows (config/__init__.py)
        if self.type == "hf" and self.columns:
            keys = set(self.columns)
            if "messages" not in keys and not {"prompt", "answer"} <= keys and not {"chosen", "rejected"} <= keys:
                raise ValueError(f"columns: needs 'messages', both 'prompt' and 'answer', or (train.mode = \"dpo\") both "
                                 f"'chosen' and 'rejected', got {sorted(keys)}")
            allowed = {"messages", "images", "image", "video", "prompt", "answer", "system", "chosen", "rejected"}
            unknown = sorted(keys - allowed)
            if unknown:
                raise ValueError(f"columns: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")
            # the messages layout reads its turns, images and system turn; these belong to the prompt / answer one
            # (chosen / rejected beside messages: refused by mode, config/mode_keys.py)
            unread = sorted(keys & {"prompt", "answer"}) if "messages" in keys and not keys & {
                "chosen", "rejected"} else []
            if unread:
                raise ValueError(f"columns: {unread[0]!r} is not read beside 'messages' (a messages column reads the "
                                 "conversation with its 'image' / 'images', 'video' and 'system' columns); remove it")
        reserved = sorted(set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs.{reserved[0]}: set by the pipeline itself (it renders "
                             "conversations, tools and generation prompts as each mode needs); remove it")
        for name in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels: {self.min_pixels} is larger than max_pixels {self.max_pixels}")
        if self.video_min_pixels and self.video_max_pixels and self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"video_min_pixels: {self.video_min_pixels} is larger than video_max_pixels {self.video_max_pixels}")
        above(self, 0, "max_frames", "fps", "max_image_pixels", "max_video_pixels", "video_decode_timeout_s")
        if self.loader_timeout_s < 0:
            raise ValueError(f"loader_timeout_s: must be >= 0 (0 = no timeout), got {self.loader_timeout_s}")
        at_least(self, 16, "max_tokens_per_pack")
        at_least(self, 0, "num_workers")
        above(self, 0, "prefetch_factor", "synthetic_train_size")
        at_least(self, 0, "synthetic_eval_size")
        if self.synthetic_image_size < 28 or self.synthetic_image_size % 28:
            raise ValueError(f"synthetic_image_size: must be a positive multiple of 28, got {self.synthetic_image_size}")
