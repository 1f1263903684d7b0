"""Tiny, offline Qwen3-VL artefacts for tests and the CPU demo.

* Model tests: `tiny_qwen3_vl_config` (a transformers `Qwen3VLConfig` / `Qwen3VLMoeConfig` with a
  320-token vocabulary, placeholder ids at its top), `hf_reference_model` (transformers' model with
  every norm weight and bias randomised: transformers starts them as constants, which would hide a
  mis-mapped weight), and input builders that lay tokens out as Qwen3-VL's processor does
  (`<vision_start>` + placeholders + `<vision_end>` per image; per video frame a `<t seconds>`
  timestamp text before its own start / placeholders / end run).
* Processor folder: `build_tiny_qwen3_vl_processor(out_dir)` writes tokenizer + chat template +
  preprocessor configs of a real Qwen3-VL checkpoint's layout (patch 16, merge 2, temporal patch 2).
* Demo: `build_tiny_qwen3_vl_folder(out_dir, seed)` writes a complete, loadable model folder.

Everything is built by code, deterministically; nothing is downloaded.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import torch

from megatron_vlm.testing.folders import (
    QWEN_VL_ITEMS,
    chatml_template,
    pad_rows,
    save_image_processor,
    save_random_model,
    write_json,
)
from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer

VOCAB = 320
IMAGE_TOKEN_ID = 300
VIDEO_TOKEN_ID = 301
VISION_START_TOKEN_ID = 302
VISION_END_TOKEN_ID = 303
PAD_TOKEN_ID = 0
PATCH = 16
MERGE = 2
PATCH_DIM = 3 * 2 * PATCH * PATCH
TIMESTAMP_TOKENS = 3  # text tokens standing for "<1.5 seconds>" before each video frame


# ----------------------------------------------------------------------------- model configs
def _mrope_section(head_dim: int) -> list[int]:
    """[t, h, w] frequency counts summing to head_dim / 2 (head_dim 16 -> [2, 3, 3])."""
    half = head_dim // 2
    hw = (half + 1) // 3
    return [half - 2 * hw, hw, hw]


def tiny_qwen3_vl_config(
    *,
    moe: bool = False,
    tie_word_embeddings: bool = False,
    text_layers: int = 3,
    vision_depth: int = 3,
    deepstack_visual_indexes=(0, 2),
    vocab_size: int = VOCAB,
    hidden_size: int = 64,
    token_ids: Optional[dict] = None,
):
    """A transformers `Qwen3VLConfig` (or `Qwen3VLMoeConfig`) in the transformers >= 5 layout.

    Text: hidden 64, 4 heads / 2 kv heads, head_dim 16, interleaved mrope_section [2, 3, 3]. Vision:
    hidden 32 (2 heads), patch 16, a 4 x 4 learned position table (so grids both larger and smaller
    than the table are resampled), DeepStack from vision blocks 0 and 2. MoE: 4 experts, top-2,
    expert width 24 (shapes that tell the hub's transposed expert layout apart), layer 1 dense."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = token_ids or {
        "image_token_id": IMAGE_TOKEN_ID, "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID, "vision_end_token_id": VISION_END_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID, "eos_token_id": 1, "bos_token_id": None,
    }
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=text_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": _mrope_section(hidden_size // 4), "mrope_interleaved": True},
        pad_token_id=ids.get("pad_token_id"), eos_token_id=ids.get("eos_token_id"), bos_token_id=ids.get("bos_token_id"),
    )
    vision = dict(
        depth=vision_depth, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=hidden_size,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=16,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
    )
    top = dict(
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=tie_word_embeddings,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                    mlp_only_layers=[1])
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **top)


def tiny_qwen3_vl_config_dict(**kw) -> dict:
    cfg = tiny_qwen3_vl_config(**kw)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3VLMoeForConditionalGeneration" if kw.get("moe") else "Qwen3VLForConditionalGeneration"]
    return d


@torch.no_grad()
def randomize_constants_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every 1-D parameter (norm weights, biases) random values: norms ~ 1 + 0.3 N, biases ~ 0.2 N."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() != 1:
            continue
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.copy_(0.2 * noise if name.endswith("bias") else 1.0 + 0.3 * noise)
    return model


def hf_reference_model(seed: int = 0, **config_kw):
    """transformers' Qwen3-VL (or -MoE) model, fp32, eager attention, eval mode, random norms / biases."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    cfg = tiny_qwen3_vl_config(**config_kw)
    cls = Qwen3VLMoeForConditionalGeneration if config_kw.get("moe") else Qwen3VLForConditionalGeneration
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_constants_(model, seed)
    return model.eval()


# ----------------------------------------------------------------------------- model inputs
def _text(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, 290, (n,), generator=gen).tolist()


def build_sample(parts, gen: torch.Generator) -> dict:
    """parts: ints (text runs) and ("image" | "video", (t, h, w)) items -> ids, pixels and grids.

    Images: <vision_start> + t*h*w/4 image placeholders + <vision_end>. Videos (t temporal patches):
    per patch, a timestamp text run then <vision_start> + h*w/4 video placeholders + <vision_end>."""
    ids, img_px, img_grid, vid_px, vid_grid = [], [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += _text(part, gen)
            continue
        kind, (t, h, w) = part
        if kind == "image":
            ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // MERGE**2) + [VISION_END_TOKEN_ID]
            img_px.append(torch.randn(t * h * w, PATCH_DIM, generator=gen))
            img_grid.append([t, h, w])
        else:
            for _ in range(t):
                ids += _text(TIMESTAMP_TOKENS, gen)
                ids += [VISION_START_TOKEN_ID] + [VIDEO_TOKEN_ID] * (h * w // MERGE**2) + [VISION_END_TOKEN_ID]
            vid_px.append(torch.randn(t * h * w, PATCH_DIM, generator=gen))
            vid_grid.append([t, h, w])
    return {
        "input_ids": ids,
        "pixel_values": torch.cat(img_px) if img_px else None,
        "image_grid_thw": torch.tensor(img_grid) if img_grid else None,
        "pixel_values_videos": torch.cat(vid_px) if vid_px else None,
        "video_grid_thw": torch.tensor(vid_grid) if vid_grid else None,
    }


def mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """What the HF processor returns: 0 text, 1 image placeholder, 2 video placeholder."""
    out = torch.zeros_like(input_ids)
    out[input_ids == IMAGE_TOKEN_ID] = 1
    out[input_ids == VIDEO_TOKEN_ID] = 2
    return out


def cat_or_none(xs):
    xs = [x for x in xs if x is not None]
    return torch.cat(xs) if xs else None


def batch_samples(samples: list[dict], *, padding_side: str = "right") -> dict:
    """Pad samples into a batch (pad id 0) with attention_mask and mm_token_type_ids; vision inputs concatenated."""
    input_ids, attention_mask = pad_rows([s["input_ids"] for s in samples], PAD_TOKEN_ID, padding_side)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids(input_ids),
        "pixel_values": cat_or_none([s["pixel_values"] for s in samples]),
        "image_grid_thw": cat_or_none([s["image_grid_thw"] for s in samples]),
        "pixel_values_videos": cat_or_none([s["pixel_values_videos"] for s in samples]),
        "video_grid_thw": cat_or_none([s["video_grid_thw"] for s in samples]),
    }


def pack_samples(samples: list[dict]) -> dict:
    """One packed row: input_ids [1, T], cu_seqlens (int32) and the concatenated vision inputs."""
    lengths = [len(s["input_ids"]) for s in samples]
    return {
        "input_ids": torch.tensor([sum((s["input_ids"] for s in samples), [])]),
        "cu_seqlens": torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32),
        "pixel_values": cat_or_none([s["pixel_values"] for s in samples]),
        "image_grid_thw": cat_or_none([s["image_grid_thw"] for s in samples]),
        "pixel_values_videos": cat_or_none([s["pixel_values_videos"] for s in samples]),
        "video_grid_thw": cat_or_none([s["video_grid_thw"] for s in samples]),
    }


# ----------------------------------------------------------------------------- processor folder
TINY_IMAGE_MIN_PIXELS = 64 * 64
TINY_IMAGE_MAX_PIXELS = 32 * 32 * 16  # at most 16 merged tokens per image (e.g. 128 x 128)
TINY_VIDEO_MIN_PIXELS = 64 * 64
TINY_VIDEO_MAX_PIXELS = 32 * 32 * 4  # at most 4 merged tokens per temporal patch

# Behaviour of Qwen3-VL-Instruct's chat template (written here, not copied): no default system turn;
# string content verbatim; list content renders images / videos as vision placeholders (optionally
# labelled "Picture N: " / "Video N: ") and text as is; generation prompt "<|im_start|>assistant\n".
QWEN3_VL_CHAT_TEMPLATE = chatml_template(QWEN_VL_ITEMS, count_items=True)



def build_tiny_qwen3_vl_processor(out_dir: str | os.PathLike, *, extra_words: Iterable[str] = ()) -> Path:
    """Write a Qwen3-VL tokenizer + processor folder into `out_dir` (same inputs -> same files).

    The layout of a real Qwen3-VL checkpoint: tokenizer.json / tokenizer_config.json (the tiny
    byte-level BPE of `megatron_vlm.testing.tiny_processor` with the Qwen specials),
    chat_template.jinja, preprocessor_config.json (`Qwen2VLImageProcessorFast`, patch 16, merge 2,
    temporal patch 2, mean / std 0.5), video_preprocessor_config.json (`Qwen3VLVideoProcessor`) and
    processor_config.json (`Qwen3VLProcessor`). Returns the folder."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(list(extra_words))
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        min_pixels=TINY_IMAGE_MIN_PIXELS, max_pixels=TINY_IMAGE_MAX_PIXELS,
    )
    save_image_processor(out, image_processor, "Qwen2VLImageProcessorFast", "Qwen3VLProcessor")  # what Qwen3-VL checkpoints name
    write_json(out / "video_preprocessor_config.json", {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": TINY_VIDEO_MIN_PIXELS, "longest_edge": TINY_VIDEO_MAX_PIXELS},
        "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE, "fps": 2, "do_sample_frames": False,
    })
    write_json(out / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})
    return out


def tiny_qwen3_vl_token_ids(tokenizer) -> dict:
    """Token ids a Qwen3-VL config.json needs for this tokenizer, and vocab_size = len rounded up to 64."""
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in (
        ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("pad_token_id", "<|endoftext|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    )}
    ids["vocab_size"] = (len(tokenizer) + 63) // 64 * 64
    return ids


def build_tiny_qwen3_vl_folder(out_dir: str | os.PathLike, seed: int = 0, *, moe: bool = False) -> Path:
    """A complete tiny Qwen3-VL (or -MoE) model folder for the CPU demo: processor files (above), config.json
    (text width 128, 2 decoder layers, 2 vision blocks with DeepStack from block 0; tied embeddings like
    Qwen3-VL-2B) and random weights from `seed`, written by `save_hf_model` (so transformers loads it).
    Built in `<out_dir>.tmp` and renamed, so a crash never leaves half a folder."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    build_tiny_qwen3_vl_processor(tmp)
    ids = tiny_qwen3_vl_token_ids(AutoTokenizer.from_pretrained(tmp))
    cfg = tiny_qwen3_vl_config(
        moe=moe, tie_word_embeddings=True, text_layers=2, vision_depth=2, deepstack_visual_indexes=(0,),
        vocab_size=ids["vocab_size"], hidden_size=128, token_ids=ids,
    ).to_dict()
    cfg["architectures"] = ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"]
    save_random_model(cfg, tmp, seed)
    tmp.rename(out)
    return out
