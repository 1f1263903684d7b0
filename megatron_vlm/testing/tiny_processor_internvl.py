"""Tiny, offline InternVL artefacts for tests and the CPU demo.

* Model tests: `tiny_internvl_config` (a transformers `InternVLConfig`: 56-pixel tiles of 4 x 4
  patches -> 4 tokens per tile after the 0.5 pixel shuffle; a Qwen2 or Qwen3 decoder; LayerNorm or
  RMSNorm + QK-norm InternViT), `hf_reference_model` (transformers' model with every norm weight,
  bias, layer scale, CLS token and position table randomised: transformers starts them as constants
  or zeros, which would hide a mis-mapped weight), input builders laying tokens out as
  `InternVLProcessor` does (`<img>` + tiles x 4 `<IMG_CONTEXT>` + `</img>` per image; per video
  frame "FrameN: " text then one tile's `<img>...</img>`), and `to_opengvlab_layout`, which renames
  a transformers state dict to OpenGVLab's remote-code layout following the key table of
  transformers' conversion script (convert_internvl_weights_to_hf.py), read backwards.
* Processor folder / demo: see `build_tiny_internvl_processor` and `build_tiny_internvl_folder`.

Everything is built by code, deterministically; nothing is downloaded.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import torch

from megatron_vlm.testing.folders import chatml_template, pad_rows, save_image_processor, save_random_model, write_json
from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer

VOCAB = 320
IMAGE_TOKEN_ID = 300  # <IMG_CONTEXT>
IMG_START_TOKEN_ID = 301  # <img>
IMG_END_TOKEN_ID = 302  # </img>
PAD_TOKEN_ID = 0
TILE = 56
TOKENS_PER_TILE = 4
FRAME_LABEL_TOKENS = 2  # text tokens standing for "Frame1: "


# ----------------------------------------------------------------------------- model configs
def tiny_internvl_config(
    *,
    text_model: str = "qwen2",
    norm_type: str = "layer_norm",
    use_qk_norm: bool = False,
    tie_word_embeddings: bool = False,
    use_mean_pooling: bool = True,
    vision_feature_layer: int = -1,
    vocab_size: int = VOCAB,
    hidden_size: int = 64,
    token_ids: Optional[dict] = None,
):
    """A transformers `InternVLConfig`: InternViT hidden 32 (2 heads, 2 layers, qkv bias), 56 x 56 tiles of
    14-pixel patches; a 2-layer Qwen2 (qkv bias) or Qwen3 (QK-norm, head_dim 16) decoder of width 64."""
    from transformers import InternVLConfig

    ids = token_ids or {"image_token_id": IMAGE_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID, "eos_token_id": 1,
                        "bos_token_id": None}
    text = dict(
        model_type=text_model, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=ids.get("pad_token_id"), eos_token_id=ids.get("eos_token_id"), bos_token_id=ids.get("bos_token_id"),
    )
    if text_model == "qwen3":
        text["head_dim"] = hidden_size // 4
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
        patch_size=14, attention_bias=True, use_qk_norm=use_qk_norm, norm_type=norm_type, layer_norm_eps=1e-6,
        use_mean_pooling=use_mean_pooling,
    )
    return InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["image_token_id"],
        image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5, vision_feature_layer=vision_feature_layer,
        tie_word_embeddings=tie_word_embeddings,
    )


def tiny_internvl_config_dict(**kw) -> dict:
    d = tiny_internvl_config(**kw).to_dict()
    d["architectures"] = ["InternVLForConditionalGeneration"]
    return d


@torch.no_grad()
def randomize_constants_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights / layer scales ~ 1 + 0.3 N, biases ~ 0.2 N, CLS token / position table ~ 0.5 N."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith(("cls_token", "position_embeddings")):
            p.copy_(0.5 * noise)
        elif p.dim() == 1:
            p.copy_(0.2 * noise if name.endswith("bias") else 1.0 + 0.3 * noise)
    return model


def hf_reference_model(seed: int = 0, **config_kw):
    """transformers' InternVLForConditionalGeneration, fp32, eager attention, eval mode, randomised constants."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = tiny_internvl_config(**config_kw)
    model = InternVLForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_constants_(model, seed)
    return model.eval()


_OPENGVLAB_VISION = [  # transformers' conversion table, read backwards (transformers name -> original)
    (r"^vision_tower\.", "vision_model."),
    (r"\.encoder\.layer\.", ".encoder.layers."),
    (r"\.cls_token$", ".class_embedding"),
    (r"\.position_embeddings$", ".position_embedding"),
    (r"\.patch_embeddings\.projection\.", ".patch_embedding."),
    (r"\.lambda_([12])$", r".ls\1"),
    (r"\.attention\.projection_layer\.", ".attn.proj."),
    (r"\.attention\.", ".attn."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
]
_OPENGVLAB_PROJECTOR = {"layer_norm": "0", "linear_1": "1", "linear_2": "3"}


def to_opengvlab_layout(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers InternVL checkpoint (save_pretrained layout) in OpenGVLab's remote-code key layout:
    `vision_model.*` with fused `attn.qkv`, `mlp1.{0,1,3}`, `language_model.*` unchanged."""
    out, qkv = {}, {}
    for key, t in hf_state_dict.items():
        if key.startswith("vision_tower."):
            new = key
            for pattern, repl in _OPENGVLAB_VISION:
                new = re.sub(pattern, repl, new)
            m = re.match(r"^(vision_model\.encoder\.layers\.\d+\.attn)\.([qkv])_proj\.(weight|bias)$", new)
            if m:
                qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = t
                continue
            out[new] = t
        elif key.startswith("multi_modal_projector."):
            _, mod, param = key.split(".")
            out[f"mlp1.{_OPENGVLAB_PROJECTOR[mod]}.{param}"] = t
        else:
            out[key] = t
    for (prefix, kind), parts in qkv.items():
        out[f"{prefix}.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


# ----------------------------------------------------------------------------- model inputs
def _text(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, 290, (n,), generator=gen).tolist()


def build_sample(parts, gen: torch.Generator) -> dict:
    """parts: ints (text runs), ("image", n_tiles) and ("video", n_frames) -> ids and tiles [n, 3, 56, 56]."""
    ids, tiles = [], []
    for part in parts:
        if isinstance(part, int):
            ids += _text(part, gen)
            continue
        kind, n = part
        if kind == "image":
            ids += [IMG_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (TOKENS_PER_TILE * n) + [IMG_END_TOKEN_ID]
        else:
            for _ in range(n):
                ids += _text(FRAME_LABEL_TOKENS, gen)
                ids += [IMG_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * TOKENS_PER_TILE + [IMG_END_TOKEN_ID]
        tiles.append(torch.randn(n, 3, TILE, TILE, generator=gen))
    return {"input_ids": ids, "pixel_values": torch.cat(tiles) if tiles else None}


def batch_samples(samples: list[dict], *, padding_side: str = "left") -> dict:
    """Pad samples into a batch (pad id 0) with attention_mask; tiles concatenated in order."""
    input_ids, attention_mask = pad_rows([s["input_ids"] for s in samples], PAD_TOKEN_ID, padding_side)
    tiles = [s["pixel_values"] for s in samples if s["pixel_values"] is not None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.cat(tiles) if tiles else None,
    }


def pack_samples(samples: list[dict]) -> dict:
    """One packed row: input_ids [1, T], cu_seqlens (int32) and the concatenated tiles."""
    lengths = [len(s["input_ids"]) for s in samples]
    tiles = [s["pixel_values"] for s in samples if s["pixel_values"] is not None]
    return {
        "input_ids": torch.tensor([sum((s["input_ids"] for s in samples), [])]),
        "cu_seqlens": torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32),
        "pixel_values": torch.cat(tiles) if tiles else None,
    }


# ----------------------------------------------------------------------------- processor folder
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
TINY_MAX_TILES = 4

# Behaviour of the InternVL `-hf` chat template (written here, not copied): ChatML turns, no default
# system turn; an image item renders as "<IMG_CONTEXT>\n" (the processor expands it to
# <img> + tiles x image_seq_length <IMG_CONTEXT> + </img>), a video item as "<video>\n" (expanded to
# "Frame1: <img>...</img>\nFrame2: ..."), text as is; generation prompt "<|im_start|>assistant\n".
INTERNVL_CHAT_TEMPLATE = chatml_template(
    "{% if item['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif item['type'] == 'video' %}<video>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}"
)
_INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                    "video_token": "<video>"}


def build_tiny_internvl_processor(out_dir, *, extra_words=(), tile_size: int = TILE, image_seq_length: int = TOKENS_PER_TILE):
    """Write an InternVL (`-hf` layout) tokenizer + processor folder into `out_dir`; returns the folder.

    tokenizer.json / tokenizer_config.json: the tiny byte-level BPE of `megatron_vlm.testing.
    tiny_processor` plus `<img>`, `</img>`, `<IMG_CONTEXT>`, `<video>`, named in `extra_special_tokens`
    as transformers' `InternVLProcessor` expects; chat_template.jinja; preprocessor_config.json
    (`GotOcr2ImageProcessor`: `tile_size`-pixel tiles, dynamic tiling into 1..4 tiles + thumbnail,
    ImageNet mean / std); video_preprocessor_config.json (`InternVLVideoProcessor`, one tile per
    frame); processor_config.json (`InternVLProcessor`, `image_seq_length` tokens per tile)."""
    from pathlib import Path

    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(list(extra_words))
    tokenizer.add_tokens(list(_INTERNVL_TOKENS.values()), special_tokens=True)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = dict(_INTERNVL_TOKENS)
    write_json(out / "tokenizer_config.json", cfg)
    (out / "chat_template.jinja").write_text(INTERNVL_CHAT_TEMPLATE)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile_size, "width": tile_size}, crop_to_patches=True, min_patches=1, max_patches=TINY_MAX_TILES,
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, do_convert_rgb=True,
    )
    save_image_processor(out, image_processor, "GotOcr2ImageProcessor", "InternVLProcessor")
    write_json(out / "video_preprocessor_config.json", {
        "video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor",
        "do_resize": True, "size": {"height": tile_size, "width": tile_size}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
        "do_convert_rgb": True, "resample": 3, "do_sample_frames": False,
    })
    write_json(out / "processor_config.json", {"processor_class": "InternVLProcessor",
                                                "image_seq_length": image_seq_length})
    return out


def tiny_internvl_token_ids(tokenizer) -> dict:
    """Token ids an InternVL config.json needs for this tokenizer, and vocab_size = len rounded up to 64."""
    return {
        "image_token_id": tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "bos_token_id": None,
        "vocab_size": (len(tokenizer) + 63) // 64 * 64,
    }


def build_tiny_internvl_folder(out_dir, seed: int = 0, *, text_model: str = "qwen2"):
    """A complete tiny InternVL model folder for the CPU demo: processor files (above), config.json (a Qwen2
    or Qwen3 decoder of width 128 with 2 layers, a 2-layer InternViT on 56-pixel tiles -> 4 tokens per tile)
    and random weights from `seed`, written by `save_hf_model` (so transformers loads it). Built in
    `<out_dir>.tmp` and renamed, so a crash never leaves half a folder."""
    from pathlib import Path

    from transformers import AutoTokenizer

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    build_tiny_internvl_processor(tmp)
    ids = tiny_internvl_token_ids(AutoTokenizer.from_pretrained(tmp))
    cfg = tiny_internvl_config(text_model=text_model, tie_word_embeddings=False, vocab_size=ids["vocab_size"],
                               hidden_size=128, token_ids=ids).to_dict()
    cfg["architectures"] = ["InternVLForConditionalGeneration"]
    save_random_model(cfg, tmp, seed)
    tmp.rename(out)
    return out
