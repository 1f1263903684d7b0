"""Qwen3-VL / Qwen3-VL-MoE model arguments, built from a Hugging Face `config.json` dict.

Both `model_type`s share one family: `qwen3_vl` (dense Qwen3 decoder) and `qwen3_vl_moe` (Qwen3-MoE
decoder: softmax top-k router, SwiGLU experts, MoE in every `decoder_sparse_step`-th layer except
`mlp_only_layers`). The vision tower (ViT with LayerNorm, learned position table resampled to each
grid, 2-D rotary, DeepStack mergers) is the same for both.

Config layouts accepted: transformers >= 5 (`rope_parameters` in `text_config`) and the hub layout
written by transformers 4.57 (`rope_scaling` = {"rope_type": "default", "mrope_section": [...],
"mrope_interleaved": true} next to `rope_theta`). Qwen3-VL always uses the interleaved M-RoPE layout
(transformers ignores `mrope_interleaved`; so do we). Unsupported settings (a RoPE type other than
default, a decoder activation other than SiLU) are errors naming the key.

Defaults follow transformers' config classes where a key is absent (e.g. dense `head_dim` 128, MoE
`head_dim` = hidden / heads, text `rope_theta` 500000, `tie_word_embeddings` False).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_vlm.models.common.mlp import get_activation
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

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def _rope_settings(cfg: dict) -> tuple[Optional[float], Optional[list[int]], str]:
    """(rope_theta or None, mrope_section or None, rope_type) from `rope_parameters` or `rope_scaling` + `rope_theta`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":
        rope_type = "default"
    section = params.get("mrope_section")
    return (float(theta) if theta is not None else None), (list(section) if section is not None else None), rope_type


@dataclass(kw_only=True)
class Qwen3VLVisionArgs:
    """The vision tower: patch embed (bias) + learned positions + ViT blocks + merger + DeepStack mergers."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # hard-coded in the reference implementation, not in config.json

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_hf(cls, vc: dict) -> Qwen3VLVisionArgs:
        kw: dict[str, Any] = {"rope_theta": vit_rope_theta(vc)}
        for name in {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "norm_eps"}:
            if vc.get(name) is not None:
                kw[name] = vc[name]
        if "in_channels" not in kw and "in_chans" in vc:
            kw["in_channels"] = vc["in_chans"]
        for name in ("patch_size", "temporal_patch_size"):
            if isinstance(kw.get(name), (list, tuple)):
                if len(set(kw[name])) != 1:
                    raise ValueError(f"vision_config.{name}: non-square patches {kw[name]} are not supported")
                kw[name] = kw[name][0]
        kw["deepstack_visual_indexes"] = list(kw.get("deepstack_visual_indexes", [8, 16, 24]))
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        check_vit_heads(self)
        if self.num_grid_per_side**2 != self.num_position_embeddings:
            raise ValueError(
                f"vision_config.num_position_embeddings {self.num_position_embeddings} must be a square (a side x side table)"
            )
        for i in self.deepstack_visual_indexes:
            if not 0 <= i < self.depth:
                raise ValueError(f"vision_config.deepstack_visual_indexes: {i} is outside [0, depth={self.depth})")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"vision_config.deepstack_visual_indexes: {self.deepstack_visual_indexes} has repeats")
        get_activation(self.hidden_act)

    def to_hf(self, model_type: str) -> dict:
        return {
            "model_type": f"{model_type}_vision",
            **vit_hf_fields(self),
            "out_hidden_size": self.out_hidden_size,
            "num_position_embeddings": self.num_position_embeddings,
            "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }


@dataclass(kw_only=True)
class Qwen3VLTextArgs:
    """The Qwen3 decoder (GQA, QK-norm, interleaved M-RoPE); `num_experts > 0` makes it Qwen3-MoE.
    `mrope_section` None: 1-D RoPE, the text-only Qwen3(-MoE) of `models/qwen_text`, which builds
    these args itself (with its own `norm_topk_prob`; Qwen3-VL-MoE always renormalises)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 500000.0
    mrope_section: Optional[list[int]] = field(default_factory=lambda: [24, 20, 20])
    attention_bias: bool = False
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"
    # MoE (qwen3_vl_moe); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True  # renormalise the top-k router weights (transformers' Qwen3-VL-MoE always does)
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001  # read and written back; not applied by the model (transformers adds it
    # only with output_router_logits); load balancing in training is the trainer's MoE setting

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, tc: dict, *, moe: bool) -> Qwen3VLTextArgs:
        theta, section, rope_type = _rope_settings(tc)
        if rope_type != "default":
            raise ValueError(f"text_config.rope_parameters.rope_type: only default M-RoPE is supported, got {rope_type!r}")
        kw: dict[str, Any] = {}
        if theta is not None:
            kw["rope_theta"] = theta
        if section is not None:
            kw["mrope_section"] = section
        names = [*DECODER_FIELDS, "head_dim", "attention_bias"]
        if moe:
            names += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                      "mlp_only_layers", "router_aux_loss_coef"]
        kw.update(given_fields(tc, names))
        if moe and "num_experts" not in kw and tc.get("num_local_experts") is not None:
            kw["num_experts"] = tc["num_local_experts"]  # transformers >= 5 writes the attribute-map name
        if moe:
            # transformers' MoE text config: hidden_size 2048, 16 heads, head_dim = hidden / heads when absent
            kw.setdefault("hidden_size", 2048)
            kw.setdefault("num_attention_heads", 16)
            kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
            kw.setdefault("num_hidden_layers", 24)
            kw.setdefault("intermediate_size", 5632)
            kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
            kw.setdefault("num_experts", 60)
            kw["mlp_only_layers"] = list(kw.get("mlp_only_layers") or [])
        elif tc.get("num_key_value_heads") is None and "num_attention_heads" in tc:
            kw["num_key_value_heads"] = tc["num_attention_heads"]
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        check_swiglu_decoder(self)
        check_mrope_section(self)
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"text_config.num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(f"text_config.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def to_hf(self, model_type: str) -> dict:
        out = {
            "model_type": f"{model_type}_text",
            **decoder_hf_fields(self),
            "head_dim": self.head_dim,
            "attention_bias": self.attention_bias,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": self.rope_theta, "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
        }
        if self.num_experts:
            out.update(
                num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers), router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return out


@dataclass(kw_only=True)
class Qwen3VLArgs:
    """Everything the Qwen3-VL module needs; `from_hf_config` is the constructor real code uses."""

    model_type: str = "qwen3_vl"
    text: Qwen3VLTextArgs = field(default_factory=Qwen3VLTextArgs)
    vision: Qwen3VLVisionArgs = field(default_factory=Qwen3VLVisionArgs)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.text.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen3VLArgs:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if "vision_config" not in cfg:
            raise ValueError(f"config.json: {model_type} config has no vision_config")
        if "tie_word_embeddings" in cfg:  # transformers reads the top-level flag of composite configs
            tie = bool(cfg["tie_word_embeddings"])
        else:
            tie = bool((cfg.get("text_config") or {}).get("tie_word_embeddings", False))
        kw = given_token_ids(cfg)
        args = cls(
            model_type=model_type,
            text=Qwen3VLTextArgs.from_hf(text_sub_config(cfg), moe=model_type == "qwen3_vl_moe"),
            vision=Qwen3VLVisionArgs.from_hf(cfg["vision_config"]),
            tie_word_embeddings=tie,
            **kw,
        )
        args.validate()
        return args

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"Qwen3VLArgs.model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if (self.model_type == "qwen3_vl_moe") != self.is_moe:
            raise ValueError(
                f"model_type {self.model_type!r} but text num_experts = {self.text.num_experts} "
                "(qwen3_vl_moe needs experts, qwen3_vl has none)"
            )
        self.text.validate()
        self.vision.validate()
        check_merger_width(self.vision, self.text)
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ValueError(
                f"vision_config.deepstack_visual_indexes has {len(self.vision.deepstack_visual_indexes)} entries but the "
                f"decoder has only {self.text.num_hidden_layers} layers to receive them"
            )

    def to_hf_config(self) -> dict:
        """A transformers >= 5 style config.json dict describing these args (used when no original exists)."""
        arch = "Qwen3VLMoeForConditionalGeneration" if self.is_moe else "Qwen3VLForConditionalGeneration"
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.text.to_hf(self.model_type),
            "vision_config": self.vision.to_hf(self.model_type),
        }
