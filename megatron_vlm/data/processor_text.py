"""The processor of a text-only model folder (Qwen2 / Qwen2.5-Math, Qwen3, ...): tokenizer + chat template.

`load_processor(folder)` returns a `TextProcessor` for a folder that has a tokenizer and a
config.json without `vision_config` (and no preprocessor_config.json). It has the `VLProcessor`
interface the data pipeline, the GRPO prompt encoder and the evaluators use, with no vision: no
placeholder tokens (`image_token` / `video_token` / their ids are None), so a batch never carries
pixel keys or `mm_token_type_ids`, and a record with an image or a video is a bad record
(`placeholder_mismatch`: the template writes no placeholder for it) rather than silently losing it.
"""
from __future__ import annotations

from pathlib import Path

from megatron_vlm.data.processor_base import VLProcessor, folder_chat_template, read_json

__all__ = ["TextProcessor", "is_text_model_folder", "load_text_processor"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def is_text_model_folder(folder: Path) -> bool:
    """A model folder with a tokenizer whose config.json describes no vision tower."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return False
    return "vision_config" not in read_json(folder / "config.json")


class TextProcessor(VLProcessor):
    family = "text"

    def __init__(self, tokenizer, *, chat_template: str, name_or_path: str = ""):
        super().__init__(tokenizer, chat_template=chat_template, image_token=None, video_token=None,
                         image_token_id=None, video_token_id=None, name_or_path=name_or_path)

    def _no_vision(self, what: str):
        raise ValueError(f"{self.name_or_path or 'processor'}: a text-only model cannot take {what}")

    def process_images(self, images):
        self._no_vision("images")

    def process_video(self, clip):
        self._no_vision("videos")

    def image_expansions(self, sizes):
        self._no_vision("images")

    def video_expansion(self, clip):
        self._no_vision("videos")

    def identity(self) -> dict:
        return {"family": "text"}


def load_text_processor(folder: Path) -> TextProcessor:
    from transformers import AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return TextProcessor(tokenizer, chat_template=folder_chat_template(folder, tokenizer), name_or_path=str(folder))
