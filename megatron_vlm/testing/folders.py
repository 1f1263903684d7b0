"""Pieces every tiny model folder writer shares (`tiny_processor*.py`, `tiny_nemotron_vl.py`): the JSON files,
the ChatML chat templates, the model's random init and export, and the padded batches the parity tests feed.

The chat templates reproduce the behaviour of the released checkpoints' templates (written here, not copied):
ChatML turns `<|im_start|>{role}\\n{content}<|im_end|>\\n`, string content verbatim, list content rendered item by
item as the family's processor expects its placeholders, generation prompt `<|im_start|>assistant\\n`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_vlm.checkpoint.hf import save_hf_model
from megatron_vlm.models import build_model


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def chatml_template(items: str, *, default_system: bool = False, count_items: bool = False) -> str:
    """A ChatML chat template whose list content renders each item with the jinja `items` (an if / elif chain
    on `item`); `default_system`: a first turn "You are a helpful assistant." unless the messages start with a
    system turn (Qwen2.5-VL); `count_items`: images and videos counted in `ns.images` / `ns.videos`."""
    return (
        ("{% set ns = namespace(images=0, videos=0) %}" if count_items else "")
        + "{% for message in messages %}"
        + ("{% if loop.first and message['role'] != 'system' %}"
           "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
           "{% endif %}" if default_system else "")
        + "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}"
        "{{ message['content'] }}"
        "{% else %}"
        "{% for item in message['content'] %}"
        + items
        + "{% endfor %}"
        "{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Qwen-VL list items: images / videos as vision placeholders (optionally labelled "Picture N: " / "Video N: "),
# text as is
QWEN_VL_ITEMS = (
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "{% set ns.images = ns.images + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "{% set ns.videos = ns.videos + 1 %}"
    "{% if add_vision_id %}Video {{ ns.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}"
    "{{ item['text'] }}"
    "{% endif %}"
)


def save_random_model(hf_config: dict, folder: Path, seed: int) -> None:
    """Build the family model `hf_config` names with weights drawn from `seed` (the global RNG left as it was)
    and write it to `folder` as a Hugging Face checkpoint."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(hf_config)
    save_hf_model(model, folder)


def pad_rows(rows: list[list[int]], pad_id: int, padding_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, longest], attention_mask [B, longest]) of token rows padded with `pad_id` on the left or
    the right."""
    longest = max(len(r) for r in rows)
    ids, mask = [], []
    for row in rows:
        pad, m = longest - len(row), [1] * len(row)
        if padding_side == "left":
            row, m = [pad_id] * pad + row, [0] * pad + m
        else:
            row, m = row + [pad_id] * pad, m + [0] * pad
        ids.append(row)
        mask.append(m)
    return torch.tensor(ids), torch.tensor(mask)


def save_image_processor(folder: Path, image_processor, image_processor_type: str, processor_class: str) -> dict:
    """Write `image_processor`'s preprocessor_config.json into `folder` under the class names a real checkpoint
    names (so that transformers, with torchvision, picks its default backend and AutoProcessor builds the
    family's processor); returns the written config."""
    image_processor.save_pretrained(folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre["image_processor_type"] = image_processor_type
    pre["processor_class"] = processor_class
    write_json(folder / "preprocessor_config.json", pre)
    return pre
