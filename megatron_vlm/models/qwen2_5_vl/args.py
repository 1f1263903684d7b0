"""Qwen2.5-VL model arguments, built from a Hugging Face `config.json` dict.

Two config layouts exist in the wild and both are accepted:

* the hub layout written by transformers 4.x (Qwen/Qwen2.5-VL-*-Instruct): text fields at the top
  level, `rope_scaling = {"type": "mrope", "mrope_section": [...]}`, `rope_theta` at the top level,
  `vision_config` with `in_chans` and sometimes `model_type = "qwen2_5_vl"`;
* the transformers >= 5 layout: `text_config` nested, `rope_parameters` holding `rope_theta` and
  `mrope_section`.

Unsupported settings (a sliding-window decoder, a non-default RoPE scaling, an activation other than
SiLU in the gated MLPs) are rejected with an error naming the key, never silently ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_vlm.models.common.qwen_vl_config import (
    check_merger_width,
    check_mrope_section,
    check_vit_heads,
    given_token_ids,
    text_sub_config,
    vit_hf_fields,
    vit_rope_theta,
)
from megatron_vlm.models.common.text_args import DECODER_FIELDS, check_swiglu_decoder, decoder_hf_fields, given_fields


def _rope_settings(cfg: dict) -> tuple[float, Optional[list[int]], str]:
    """(rope_theta, mrope_section, rope_type) from either `rope_parameters` or `rope_scaling` + `rope_theta`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 1000000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # the 4.x spelling of plain M-RoPE
        rope_type = "default"
    section = params.get("mrope_section")
    return float(theta), (list(section) if section is not None else None), rope_type


@dataclass(kw_only=True)
class Qwen2_5_VLVisionArgs:
    """The vision tower (ViT with window attention + 2x2 patch merger)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    out_hidden_size: int = 2048
    tokens_per_second: float = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # hard-coded in the reference implementation, not in config.json
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, vc: dict) -> Qwen2_5_VLVisionArgs:
        kw: dict[str, Any] = {"rope_theta": vit_rope_theta(vc)}
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "norm_eps"}
        for name in names:
            if name in vc:
                kw[name] = vc[name]
        if "in_channels" not in vc and "in_chans" in vc:
            kw["in_channels"] = vc["in_chans"]
        if "fullatt_block_indexes" in kw:
            kw["fullatt_block_indexes"] = list(kw["fullatt_block_indexes"])
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        check_vit_heads(self)
        for i in self.fullatt_block_indexes:
            if not 0 <= i < self.depth:
                raise ValueError(f"vision_config.fullatt_block_indexes: {i} is outside [0, depth={self.depth})")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"vision_config.window_size {self.window_size} must be a multiple of patch_size * spatial_merge_size "
                f"= {self.patch_size * self.spatial_merge_size}"
            )


@dataclass(kw_only=True)
class Qwen2_5_VLTextArgs:
    """The Qwen2 language decoder with M-RoPE (`mrope_section` None: 1-D RoPE, the text-only Qwen2 of
    `models/qwen_text`, which builds these args itself)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: Optional[list[int]] = field(default_factory=lambda: [16, 24, 24])
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, tc: dict) -> Qwen2_5_VLTextArgs:
        theta, section, rope_type = _rope_settings(tc)
        if rope_type != "default":
            raise ValueError(f"text_config.rope_parameters.rope_type: only default M-RoPE is supported, got {rope_type!r}")
        if tc.get("use_sliding_window"):
            raise ValueError("text_config.use_sliding_window: sliding-window attention in the decoder is not supported")
        kw: dict[str, Any] = {"rope_theta": theta}
        if section is not None:
            kw["mrope_section"] = section
        kw.update(given_fields(tc, DECODER_FIELDS))
        if tc.get("num_key_value_heads") is None and "num_attention_heads" in tc:
            kw["num_key_value_heads"] = tc["num_attention_heads"]
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"text_config: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        check_swiglu_decoder(self)
        check_mrope_section(self)


@dataclass(kw_only=True)
class Qwen2_5_VLArgs:
    """Everything the Qwen2.5-VL module needs; `from_hf_config` is the only constructor real code uses."""

    text: Qwen2_5_VLTextArgs = field(default_factory=Qwen2_5_VLTextArgs)
    vision: Qwen2_5_VLVisionArgs = field(default_factory=Qwen2_5_VLVisionArgs)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen2_5_VLArgs:
        if cfg.get("model_type") not in (None, "qwen2_5_vl"):
            raise ValueError(f"config.json: model_type {cfg.get('model_type')!r} is not qwen2_5_vl")
        if "vision_config" not in cfg:
            raise ValueError("config.json: qwen2_5_vl config has no vision_config")
        tie = bool(cfg.get("tie_word_embeddings", False)) or bool((cfg.get("text_config") or {}).get("tie_word_embeddings", False))
        kw = given_token_ids(cfg)
        return cls(
            text=Qwen2_5_VLTextArgs.from_hf(text_sub_config(cfg)),
            vision=Qwen2_5_VLVisionArgs.from_hf(cfg["vision_config"]),
            tie_word_embeddings=tie,
            **kw,
        )

    def validate(self) -> None:
        self.text.validate()
        self.vision.validate()
        check_merger_width(self.vision, self.text)

    def to_hf_config(self) -> dict:
        """A transformers >= 5 style config.json dict describing these args (used when no original exists)."""
        t, v = self.text, self.vision
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                **decoder_hf_fields(t),
                "use_sliding_window": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)},
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                **vit_hf_fields(v),
                "window_size": v.window_size,
                "fullatt_block_indexes": list(v.fullatt_block_indexes),
                "out_hidden_size": v.out_hidden_size,
                "tokens_per_second": v.tokens_per_second,
                "hidden_act": v.hidden_act,
                "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
            },
        }
