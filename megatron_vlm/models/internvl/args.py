"""InternVL (InternVL2.5 / InternVL3 / InternVL3.5 with a Qwen LLM) model arguments from a `config.json` dict.

Two config layouts are read:

* transformers' `internvl` (`InternVLForConditionalGeneration`, the `-hf` repos): `vision_config`
  (model_type `internvl_vision`: `attention_bias`, `use_qk_norm`, `norm_type`, `layer_norm_eps`,
  `layer_scale_init_value`, image / patch size as pairs), `text_config` (model_type `qwen2` or
  `qwen3`), `image_token_id`, `downsample_ratio`, `projector_hidden_act`, `vision_feature_layer`,
  `vision_feature_select_strategy`, `tie_word_embeddings` (top level; transformers' default True);
* OpenGVLab's remote-code `internvl_chat` (the original repos): `vision_config` (model_type
  `intern_vit_6b`: `qkv_bias`, `qk_normalization`, `norm_type`, sizes as ints), `llm_config`,
  `downsample_ratio`, `select_layer`, `ps_version` (only "v2", the pixel shuffle transformers also
  uses), and no image token id in the config: `img_context_token_id` is read when present, else
  151667 (`<IMG_CONTEXT>` of the Qwen2 / Qwen2.5 / Qwen3 tokenizers). Models built from it export a
  transformers `internvl` config, since transformers cannot read `internvl_chat` without remote code.

Supported language models: Qwen2 / Qwen2.5 (qkv bias, no QK-norm) and Qwen3 (QK-norm, explicit
head_dim); others (InternLM2, Llama, MoE LLMs) and unsupported settings (sliding-window attention, a
RoPE type other than default, the CLS-keeping feature strategy) are errors naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_vlm.models.common.mlp import get_activation
from megatron_vlm.models.common.text_args import DECODER_FIELDS, check_swiglu_decoder, decoder_hf_fields, given_fields

MODEL_TYPES = ("internvl", "internvl_chat")
TEXT_MODEL_TYPES = ("qwen2", "qwen3")
DEFAULT_IMAGE_TOKEN_ID = 151667  # <IMG_CONTEXT> in the Qwen-tokenizer InternVL releases


def _pair(value, name: str) -> int:
    """A square size from an int or an [h, w] pair."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config.{name}: only square sizes are supported, got {list(value)}")
        return int(value[0])
    return int(value)


@dataclass(kw_only=True)
class InternVisionArgs:
    """InternViT: CLS token + Conv2d patches + absolute positions, pre-norm blocks with layer scale."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    attention_bias: bool = True  # bias of q / k / v (the output projection always has one)
    use_qk_norm: bool = False  # RMSNorm over the full q / k width (InternViT-6B)
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-6
    layer_scale_init_value: float = 0.1
    image_size: int = 448
    patch_size: int = 14
    num_channels: int = 3
    use_absolute_position_embeddings: bool = True
    use_mask_token: bool = False
    use_mean_pooling: bool = True  # False adds a final LayerNorm (`layernorm`) on the last hidden state
    qk_norm_eps: float = 1e-6  # fixed in the reference implementation

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, vc: dict) -> InternVisionArgs:
        kw: dict[str, Any] = {}
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "attention_bias",
                     "use_qk_norm", "hidden_act", "norm_type", "layer_norm_eps", "layer_scale_init_value",
                     "num_channels", "use_absolute_position_embeddings", "use_mask_token", "use_mean_pooling"):
            if vc.get(name) is not None:
                kw[name] = vc[name]
        # OpenGVLab's intern_vit_6b names
        if "qkv_bias" in vc and "attention_bias" not in vc:
            kw["attention_bias"] = bool(vc["qkv_bias"])
        if "qk_normalization" in vc and "use_qk_norm" not in vc:
            kw["use_qk_norm"] = bool(vc["qk_normalization"])
        for name in ("image_size", "patch_size"):
            if vc.get(name) is not None:
                kw[name] = _pair(vc[name], name)
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision_config: hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.norm_type not in ("layer_norm", "rms_norm"):
            raise ValueError(f"vision_config.norm_type: expected 'layer_norm' or 'rms_norm', got {self.norm_type!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        get_activation(self.hidden_act)

    def to_hf(self) -> dict:
        return {
            "model_type": "internvl_vision",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "attention_bias": self.attention_bias,
            "use_qk_norm": self.use_qk_norm,
            "hidden_act": self.hidden_act,
            "norm_type": self.norm_type,
            "layer_norm_eps": self.layer_norm_eps,
            "layer_scale_init_value": self.layer_scale_init_value,
            "image_size": [self.image_size, self.image_size],
            "patch_size": [self.patch_size, self.patch_size],
            "num_channels": self.num_channels,
            "use_absolute_position_embeddings": self.use_absolute_position_embeddings,
            "use_mask_token": self.use_mask_token,
            "use_mean_pooling": self.use_mean_pooling,
        }


@dataclass(kw_only=True)
class InternVLTextArgs:
    """The Qwen2 / Qwen3 decoder (1-D RoPE)."""

    model_type: str = "qwen2"
    vocab_size: int = 151674
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    attention_bias: bool = True  # qwen2: q/k/v bias (o_proj none); qwen3: bias on all four when set
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, tc: dict) -> InternVLTextArgs:
        model_type = tc.get("model_type")
        if model_type not in TEXT_MODEL_TYPES:
            archs = tc.get("architectures")
            raise ValueError(
                f"text_config.model_type {model_type!r} (architectures {archs}) is not supported; supported language "
                f"models: {', '.join(TEXT_MODEL_TYPES)}"
            )
        params = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"text_config.rope_parameters.rope_type: only default RoPE is supported, got {rope_type!r}")
        if tc.get("use_sliding_window"):
            raise ValueError("text_config.use_sliding_window: sliding-window attention in the decoder is not supported")
        kw: dict[str, Any] = {"model_type": model_type}
        theta = params.get("rope_theta", tc.get("rope_theta"))
        kw["rope_theta"] = float(theta) if theta is not None else 10000.0  # transformers' Qwen2 / Qwen3 default
        kw.update(given_fields(tc, (*DECODER_FIELDS, "head_dim")))
        if tc.get("num_key_value_heads") is None and "num_attention_heads" in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        if model_type == "qwen2":
            kw["attention_bias"] = True
            if tc.get("head_dim") is None:
                kw["head_dim"] = kw.get("hidden_size", 3584) // kw.get("num_attention_heads", 28)
        else:
            kw["attention_bias"] = bool(tc.get("attention_bias", False))
            kw.setdefault("head_dim", 128)
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.model_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"text_config.model_type {self.model_type!r} is not one of {', '.join(TEXT_MODEL_TYPES)}")
        check_swiglu_decoder(self)
        if self.head_dim % 2:
            raise ValueError(f"text_config: head_dim {self.head_dim} must be even (rotary)")

    def to_hf(self, tie_word_embeddings: bool) -> dict:
        out = {
            "model_type": self.model_type,
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "Qwen3ForCausalLM"],
            **decoder_hf_fields(self),
            "head_dim": self.head_dim,
            "use_sliding_window": False,
            "tie_word_embeddings": tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        if self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out


@dataclass(kw_only=True)
class InternVLArgs:
    """Everything the InternVL module needs; `from_hf_config` is the constructor real code uses."""

    text: InternVLTextArgs = field(default_factory=InternVLTextArgs)
    vision: InternVisionArgs = field(default_factory=InternVisionArgs)
    image_token_id: int = DEFAULT_IMAGE_TOKEN_ID
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int = -1
    tie_word_embeddings: bool = True
    source_model_type: str = "internvl"  # "internvl_chat" when read from an OpenGVLab remote-code config

    @property
    def shuffle_factor(self) -> int:
        """Pixel shuffle groups factor x factor patches into one token (2 for downsample_ratio 0.5)."""
        return int(round(1 / self.downsample_ratio))

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.num_patches // self.shuffle_factor**2

    @classmethod
    def from_hf_config(cls, cfg: dict) -> InternVLArgs:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if "vision_config" not in cfg:
            raise ValueError(f"config.json: {model_type} config has no vision_config")
        text_key = "llm_config" if model_type == "internvl_chat" else "text_config"
        text_cfg = cfg.get(text_key)
        if text_cfg is None:
            raise ValueError(f"config.json: {model_type} config has no {text_key}")
        kw: dict[str, Any] = {"source_model_type": model_type}
        if model_type == "internvl":
            if cfg.get("vision_feature_select_strategy", "default") != "default":
                raise ValueError(
                    f"config.json: vision_feature_select_strategy {cfg['vision_feature_select_strategy']!r} is not "
                    "supported (only 'default', which drops the CLS token before the pixel shuffle)"
                )
            layer = cfg.get("vision_feature_layer", -1)
            for name in ("image_token_id", "downsample_ratio", "projector_hidden_act"):
                if cfg.get(name) is not None:
                    kw[name] = cfg[name]
            kw["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
        else:
            if cfg.get("ps_version", "v2") != "v2":
                raise ValueError(f"config.json: ps_version {cfg['ps_version']!r} is not supported (only 'v2')")
            layer = cfg.get("select_layer", -1)
            if cfg.get("downsample_ratio") is not None:
                kw["downsample_ratio"] = cfg["downsample_ratio"]
            kw["image_token_id"] = int(cfg.get("img_context_token_id") or DEFAULT_IMAGE_TOKEN_ID)
            tie = cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))
            kw["tie_word_embeddings"] = bool(tie)
        if isinstance(layer, (list, tuple)):
            raise ValueError(f"config.json: a list of vision feature layers {list(layer)} is not supported")
        kw["vision_feature_layer"] = int(layer)
        args = cls(text=InternVLTextArgs.from_hf(text_cfg), vision=InternVisionArgs.from_hf(cfg["vision_config"]), **kw)
        args.validate()
        return args

    def validate(self) -> None:
        self.text.validate()
        self.vision.validate()
        f = self.shuffle_factor
        if abs(1 / f - self.downsample_ratio) > 1e-6:
            raise ValueError(f"config.json: downsample_ratio {self.downsample_ratio} must be 1 / an integer")
        side = self.vision.image_size // self.vision.patch_size
        if side % f:
            raise ValueError(f"config.json: the {side} x {side} patch grid cannot be pixel-shuffled by {f}")
        n = self.vision.num_hidden_layers
        if not -(n + 1) <= self.vision_feature_layer <= n:
            raise ValueError(f"config.json: vision_feature_layer {self.vision_feature_layer} is outside [-{n + 1}, {n}]")
        get_activation(self.projector_hidden_act)

    def to_hf_config(self) -> dict:
        """A transformers `internvl` config.json dict describing these args."""
        return {
            "architectures": ["InternVLForConditionalGeneration"],
            "model_type": "internvl",
            "image_token_id": self.image_token_id,
            "image_seq_length": self.tokens_per_tile,
            "downsample_ratio": self.downsample_ratio,
            "projector_hidden_act": self.projector_hidden_act,
            "vision_feature_layer": self.vision_feature_layer,
            "vision_feature_select_strategy": "default",
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.text.to_hf(self.tie_word_embeddings),
            "vision_config": self.vision.to_hf(),
        }


def exported_hf_config(args: InternVLArgs, hf_config: Optional[dict]) -> dict:
    """The config.json to write on export: the original transformers config, or a converted one when the
    model came from an OpenGVLab `internvl_chat` folder (whose weights are exported in transformers' layout)."""
    if hf_config is not None and hf_config.get("model_type") == "internvl":
        return hf_config
    return args.to_hf_config()
