"""What the Qwen-VL-style `config.json` readers share: Qwen2.5-VL's, Qwen3-VL's (dense and MoE) and the
Nemotron-VL variant with the Qwen3-VL vision tower.

Their composite configs spell the same things the same way: the token ids of the image / video
placeholders and their delimiters at the top level, a `text_config` that may be absent (the 4.x hub layout
keeps the text fields at the top level) or lack the rotary settings (left at the top level), and a
`vision_config` whose ViT fields (`VIT_FIELDS`: a tower over 3-D patches with 2-D rotary and a spatial
patch merger) and `rope_parameters.rope_theta` are named alike. Each family's `args.py` reads and writes
the rest itself (windows and full-attention blocks, DeepStack, learned positions, MoE).
"""
from __future__ import annotations

from typing import Any

__all__ = ["TOKEN_ID_KEYS", "VIT_FIELDS", "given_token_ids", "text_sub_config", "vit_rope_theta", "vit_hf_fields",
           "check_vit_heads", "check_mrope_section", "check_merger_width"]

# top-level config.json token ids (the placeholders the processor expands, and the vision span delimiters)
TOKEN_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

# vision_config fields of both Qwen ViTs, read and written under the same names, in config.json order
VIT_FIELDS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
              "temporal_patch_size", "spatial_merge_size")


def given_token_ids(cfg: dict) -> dict[str, Any]:
    """The `TOKEN_ID_KEYS` entries of `cfg` that are present and not null (the defaults stand for the others)."""
    return {k: cfg[k] for k in TOKEN_ID_KEYS if cfg.get(k) is not None}


def text_sub_config(cfg: dict) -> dict:
    """The text part of a composite config: `text_config`, with the top-level rotary settings merged in when
    it has none of its own, or the whole config in the flat (4.x hub) layout."""
    text_cfg = cfg.get("text_config")
    if text_cfg is None:  # flat layout: text fields at the top level
        return cfg
    if "rope_parameters" not in text_cfg and "rope_scaling" not in text_cfg:
        return {**text_cfg, **{k: cfg[k] for k in ("rope_scaling", "rope_parameters", "rope_theta") if k in cfg}}
    return text_cfg


def vit_rope_theta(vc: dict) -> float:
    """The vision tower's 2-D rotary base (`vision_config.rope_parameters.rope_theta`, 10000 when absent)."""
    return float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def vit_hf_fields(args: Any) -> dict[str, Any]:
    """`VIT_FIELDS` of vision args as config.json entries."""
    return {name: getattr(args, name) for name in VIT_FIELDS}


def check_vit_heads(args: Any) -> None:
    """ValueError naming the key unless the heads split the width into halves of even size (2-D rotary)."""
    if args.hidden_size % args.num_heads:
        raise ValueError(f"vision_config: hidden_size {args.hidden_size} is not divisible by num_heads {args.num_heads}")
    if args.head_dim % 4:
        raise ValueError(f"vision_config: head_dim {args.head_dim} must be a multiple of 4 (2-D rotary)")


def check_mrope_section(args: Any) -> None:
    """ValueError naming the key unless `mrope_section` (None: 1-D RoPE) splits head_dim / 2 in three."""
    section = args.mrope_section
    if section is not None and (len(section) != 3 or 2 * sum(section) != args.head_dim):
        raise ValueError(
            f"text_config.rope_parameters.mrope_section: {section} must have 3 entries summing to "
            f"head_dim / 2 = {args.head_dim // 2}"
        )


def check_merger_width(vision: Any, text: Any) -> None:
    """ValueError unless the patch merger writes vectors of the decoder's width."""
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"vision_config.out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}"
        )
