"""Nemotron-H / Nemotron-3-Nano-VL model arguments, built from a Hugging Face `config.json` dict.

Two model types share this family:

* `nemotron_h` (transformers' `NemotronHForCausalLM`): the hybrid language model alone;
* `nemotron_h_omni` (transformers' `NemotronH_Omni_Reasoning_V3`): RADIO vision encoder + pixel
  shuffle + MLP projector + the same language model under `text_config` (`llm_config` in older
  releases). The audio branch is out of scope: a config with an `audio_config` is rejected.
* `nemotron_h_omni` whose `vision_config.model_type` is `qwen3_vl_vision` (or `qwen3_vl`): the
  Nemotron-3-Nano-VL variant trained by cosmos-rl, with the Qwen3-VL vision tower, its
  patch merger and DeepStack mergers (`Qwen3VLVisionArgs`, `out_hidden_size` = the NemotronH hidden
  size) in place of RADIO + projector. Layout read and written:
  `{"model_type": "nemotron_h_omni", "architectures": ["NemotronVLForConditionalGeneration"],
  "text_config": {nemotron_h fields}, "vision_config": {"model_type": "qwen3_vl_vision", Qwen3-VL
  vision fields, "video_temporal_patch_size"}, "video_temporal_patch_size", "image_token_id",
  "video_token_id", "vision_start_token_id", "vision_end_token_id"}` (token ids named as in
  Qwen3-VL's config.json; the processor is the Qwen3-VL one). Why this spelling: the top-level
  `model_type` stays `nemotron_h_omni` so that the family registry picks this family, and with the
  vision sub-config typed `qwen3_vl_vision` (transformers' `Qwen3VLVisionConfig`) plus
  `video_temporal_patch_size` (= `temporal_patch_size`), transformers' `AutoConfig` - and so
  `AutoTokenizer` on the folder - parses it; `qwen3_vl` would be parsed by transformers as a whole
  Qwen3-VL config, so it is read here but not written. transformers has no model class for this
  composition: only this package (and NVIDIA's remote code) builds the model.

The layer pattern comes from `layers_block_type` (["linear_attention", "full_attention", "mlp",
"moe"], "linear_attention" being the Mamba2 mixer) or the legacy `hybrid_override_pattern` string
("M" Mamba2, "*" attention, "-" MLP, "E" MoE). Legacy field names (`mamba_n_groups`,
`mamba_d_conv`, `mamba_chunk_size`, `img_context_token_id`, `vit_hidden_size` ...) are read as
transformers reads them. Settings the model code does not implement are rejected, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megatron_vlm.models.common.qwen_vl_config import TOKEN_ID_KEYS, given_token_ids
from megatron_vlm.models.common.text_args import check_gqa
from megatron_vlm.models.qwen3_vl.args import Qwen3VLVisionArgs

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
# legacy config.json name -> NemotronHConfig field
_TEXT_LEGACY = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
    "num_local_experts": "n_routed_experts",  # NemotronHConfig.attribute_map's name
}
_OMNI_LEGACY = {
    "img_context_token_id": "image_token_id", "video_context_token_id": "video_token_id",
    "llm_config": "text_config", "vit_hidden_size": "vision_hidden_size", "sound_config": "audio_config",
}
# vision_config.model_type values that select the Qwen3-VL vision tower ("qwen3_vl_vision" is what
# transformers' Qwen3VLVisionConfig writes; "qwen3_vl" is the family name used in hand-written configs)
QWEN3_VL_VISION_TYPES = ("qwen3_vl", "qwen3_vl_vision", "qwen3_vl_moe_vision")


def _float(value: Any) -> float:
    """JSON numbers, plus transformers' `{"__float__": "Infinity"}` encoding of inf."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


@dataclass(kw_only=True)
class NemotronHTextArgs:
    """The hybrid Mamba2 / attention / MLP / MoE decoder."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: list[str] = field(default_factory=lambda: ["linear_attention", "moe", "full_attention", "mlp"])
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    # dense MLP
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # MoE
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: Optional[int] = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @classmethod
    def from_hf(cls, tc: dict) -> NemotronHTextArgs:
        tc = dict(tc)
        for old, new in _TEXT_LEGACY.items():
            if old in tc:
                tc.setdefault(new, tc.pop(old))
        layers = tc.get("layers_block_type") or tc.get("layer_types")
        if layers is None and tc.get("hybrid_override_pattern"):
            pattern = tc["hybrid_override_pattern"]
            bad = sorted(set(pattern) - set(_PATTERN))
            if bad:
                raise ValueError(f"text_config.hybrid_override_pattern: unknown layer symbols {bad} in {pattern!r}")
            layers = [_PATTERN[c] for c in pattern]
        kw: dict[str, Any] = {}
        if layers is not None:
            kw["layers_block_type"] = list(layers)
        for f in cls.__dataclass_fields__:
            if f in tc and tc[f] is not None and f != "layers_block_type":
                kw[f] = tc[f]
        if tc.get("num_key_value_heads") is None and "num_attention_heads" in tc:
            kw["num_key_value_heads"] = tc["num_attention_heads"]
        for f in ("time_step_min", "time_step_max", "time_step_floor", "routed_scaling_factor", "layer_norm_epsilon"):
            if f in kw:
                kw[f] = _float(kw[f])
        if tc.get("attention_bias"):
            raise ValueError("text_config.attention_bias: NemotronH attention has no bias (transformers ignores it too)")
        if tc.get("sliding_window"):
            raise ValueError("text_config.sliding_window: sliding-window attention is not supported")
        if tc.get("residual_in_fp32"):
            raise ValueError("text_config.residual_in_fp32: fp32 residuals are not supported")
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        bad = sorted(set(self.layers_block_type) - set(_LAYER_TYPES))
        if bad:
            raise ValueError(f"text_config.layers_block_type: unknown layer types {bad}; known: {list(_LAYER_TYPES)}")
        if not self.layers_block_type:
            raise ValueError("text_config.layers_block_type: empty layer pattern")
        check_gqa(self)
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"text_config: n_groups {self.n_groups} must divide mamba_num_heads {self.mamba_num_heads}")
        if self.mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(f"text_config.mamba_hidden_act: only silu is supported, got {self.mamba_hidden_act!r}")
        if self.mlp_hidden_act not in ("relu2", "silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"text_config.mlp_hidden_act: unsupported activation {self.mlp_hidden_act!r}")


@dataclass(kw_only=True)
class RadioVisionArgs:
    """The RADIO ViT (C-RADIO): CPE patch generator, pre-norm LayerNorm blocks."""

    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    use_swiglu_ffn: bool = False
    qkv_bias: bool = True
    num_channels: int = 3
    patch_size: int = 16
    max_img_size: int = 2048
    num_cls_tokens: int = 3
    num_registers: int = 7
    video_temporal_patch_size: Optional[int] = None
    summary_idxs: list[int] = field(default_factory=lambda: [0, 1])

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_prefix_tokens(self) -> int:
        return self.num_cls_tokens + self.num_registers

    @property
    def mlp_hidden_size(self) -> int:
        hidden = int(self.hidden_size * self.mlp_ratio)
        if self.use_swiglu_ffn:  # two thirds, rounded up to a multiple of 8 (transformers' RadioSwiGLUFFN)
            hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
        return hidden

    @classmethod
    def from_hf(cls, vc: dict) -> RadioVisionArgs:
        kw = {f: vc[f] for f in cls.__dataclass_fields__ if vc.get(f) is not None}
        if vc.get("drop_path_rate"):
            raise ValueError("vision_config.drop_path_rate: stochastic depth is not supported")
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision_config: hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in ("gelu", "gelu_pytorch_tanh", "silu", "relu2"):
            raise ValueError(f"vision_config.hidden_act: unsupported activation {self.hidden_act!r}")


@dataclass(kw_only=True)
class NemotronVLArgs:
    """Everything the family's module needs; `vision` is None for the text-only `nemotron_h`,
    `RadioVisionArgs` for the RADIO model and `Qwen3VLVisionArgs` for the Qwen3-VL-vision variant
    (whose RADIO-only fields - downsample_ratio, projector / vision hidden sizes - are unused)."""

    text: NemotronHTextArgs = field(default_factory=NemotronHTextArgs)
    vision: Union[RadioVisionArgs, Qwen3VLVisionArgs, None] = None
    model_type: str = "nemotron_h_omni"
    downsample_ratio: float = 0.5
    projector_hidden_size: int = 4096
    vision_hidden_size: int = 1280
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None
    video_temporal_patch_size: int = 2
    video_pruning_rate: float = 0.0
    vision_start_token_id: Optional[int] = None
    vision_end_token_id: Optional[int] = None

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings

    @property
    def vision_tower(self) -> Optional[str]:
        """"radio", "qwen3_vl" or None (text only)."""
        if self.vision is None:
            return None
        return "qwen3_vl" if isinstance(self.vision, Qwen3VLVisionArgs) else "radio"

    @property
    def merge_size(self) -> int:
        """Side of the patch block merged into one LLM token by the pixel shuffle (1 / downsample_ratio)."""
        return int(round(1 / self.downsample_ratio))

    @classmethod
    def from_hf_config(cls, cfg: dict) -> NemotronVLArgs:
        model_type = cfg.get("model_type")
        if model_type == "nemotron_h":
            return cls(text=NemotronHTextArgs.from_hf(cfg), model_type="nemotron_h")
        if model_type != "nemotron_h_omni":
            raise ValueError(f"config.json: model_type {model_type!r} is not nemotron_h or nemotron_h_omni")
        cfg = dict(cfg)
        for old, new in _OMNI_LEGACY.items():
            if old in cfg and cfg.get(new) is None:
                cfg[new] = cfg.pop(old)
        if cfg.get("audio_config") is not None:
            raise ValueError("config.json: audio_config is set, but the audio branch of nemotron_h_omni is not supported")
        if cfg.get("text_config") is None or cfg.get("vision_config") is None:
            raise ValueError("config.json: nemotron_h_omni needs text_config (llm_config) and vision_config")
        if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in cfg["text_config"]:
            cfg["text_config"] = {**cfg["text_config"], "tie_word_embeddings": cfg["tie_word_embeddings"]}
        if cfg["vision_config"].get("model_type") in QWEN3_VL_VISION_TYPES:
            return cls._from_qwen3_vision_config(cfg)
        vc = dict(cfg["vision_config"])
        vc.setdefault("video_temporal_patch_size", cfg.get("video_temporal_patch_size", 2))
        kw = {k: cfg[k] for k in ("downsample_ratio", "projector_hidden_size", "vision_hidden_size", "image_token_id",
                                  "video_token_id", "video_temporal_patch_size", "video_pruning_rate")
              if cfg.get(k) is not None}
        args = cls(text=NemotronHTextArgs.from_hf(cfg["text_config"]), vision=RadioVisionArgs.from_hf(vc),
                   model_type="nemotron_h_omni", **kw)
        args.validate()
        return args

    @classmethod
    def _from_qwen3_vision_config(cls, cfg: dict) -> NemotronVLArgs:
        vc = cfg["vision_config"]
        unused = [k for k in ("downsample_ratio", "projector_hidden_size", "vision_hidden_size") if cfg.get(k) is not None]
        if unused:
            raise ValueError(
                f"config.json: {unused} describe the RADIO projector, but vision_config.model_type is "
                f"{vc.get('model_type')!r} (the Qwen3-VL patch merger is the projector)"
            )
        if cfg.get("video_pruning_rate"):
            raise ValueError("config.json: video_pruning_rate > 0 is not supported with the Qwen3-VL vision tower")
        vision = Qwen3VLVisionArgs.from_hf(vc)
        for where, value in (("video_temporal_patch_size", cfg.get("video_temporal_patch_size")),
                             ("vision_config.video_temporal_patch_size", vc.get("video_temporal_patch_size"))):
            if value is not None and value != vision.temporal_patch_size:
                raise ValueError(
                    f"config.json: {where} {value} != vision_config.temporal_patch_size {vision.temporal_patch_size}"
                )
        kw = given_token_ids(cfg)
        args = cls(text=NemotronHTextArgs.from_hf(cfg["text_config"]), vision=vision, model_type="nemotron_h_omni",
                   video_temporal_patch_size=vision.temporal_patch_size, **kw)
        args.validate()
        return args

    def validate(self) -> None:
        self.text.validate()
        if self.vision is None:
            return
        self.vision.validate()
        if isinstance(self.vision, Qwen3VLVisionArgs):
            self._validate_qwen3_vision()
            return
        if self.image_token_id is None:
            raise ValueError("config.json: image_token_id (img_context_token_id) is required for nemotron_h_omni")
        ratio = 1 / self.downsample_ratio
        if abs(ratio - round(ratio)) > 1e-6:
            raise ValueError(f"config.json: downsample_ratio {self.downsample_ratio} must be 1 / an integer")
        if self.vision_hidden_size != self.vision.hidden_size:
            raise ValueError(
                f"config.json: vision_hidden_size {self.vision_hidden_size} != vision_config.hidden_size {self.vision.hidden_size}"
            )
        if self.vision.video_temporal_patch_size not in (None, self.video_temporal_patch_size):
            raise ValueError(
                f"config.json: vision_config.video_temporal_patch_size {self.vision.video_temporal_patch_size} != "
                f"video_temporal_patch_size {self.video_temporal_patch_size}"
            )

    def _validate_qwen3_vision(self) -> None:
        v = self.vision
        if self.image_token_id is None:
            raise ValueError("config.json: image_token_id is required with the Qwen3-VL vision tower")
        if v.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"config.json: vision_config.out_hidden_size {v.out_hidden_size} != text_config.hidden_size "
                f"{self.text.hidden_size} (the patch merger writes into the decoder's embedding space)"
            )
        if len(v.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ValueError(
                f"vision_config.deepstack_visual_indexes has {len(v.deepstack_visual_indexes)} entries but the decoder "
                f"has only {self.text.num_hidden_layers} layers to receive them"
            )
        if self.video_token_id is not None and self.video_token_id == self.image_token_id:
            raise ValueError(f"config.json: video_token_id {self.video_token_id} equals image_token_id")

    def to_hf_config(self) -> dict:
        """A transformers 5 config.json dict for these args (used when the model has no original config)."""
        t = self.text
        text = {
            "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
            **{f: getattr(t, f) for f in t.__dataclass_fields__},
        }
        text["layers_block_type"] = list(t.layers_block_type)
        if self.vision is None:
            return text
        if isinstance(self.vision, Qwen3VLVisionArgs):
            text.pop("architectures")
            tp = self.vision.temporal_patch_size
            out = {
                "architectures": ["NemotronVLForConditionalGeneration"],
                "model_type": "nemotron_h_omni",
                "text_config": text,
                "vision_config": {**self.vision.to_hf("qwen3_vl"), "video_temporal_patch_size": tp},
                "video_temporal_patch_size": tp,
            }
            out.update({k: getattr(self, k) for k in TOKEN_ID_KEYS if getattr(self, k) is not None})
            return out
        v = self.vision
        vision = {"model_type": "radio", **{f: getattr(v, f) for f in v.__dataclass_fields__}}
        vision["summary_idxs"] = list(v.summary_idxs)
        text.pop("architectures")
        return {
            "architectures": ["NemotronH_Omni_Reasoning_V3"],
            "model_type": "nemotron_h_omni",
            "text_config": text,
            "vision_config": vision,
            "audio_config": None,
            "downsample_ratio": self.downsample_ratio,
            "projector_hidden_size": self.projector_hidden_size,
            "vision_hidden_size": self.vision_hidden_size,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "video_temporal_patch_size": self.video_temporal_patch_size,
            "video_pruning_rate": self.video_pruning_rate,
        }


__all__ = ["NemotronHTextArgs", "RadioVisionArgs", "NemotronVLArgs"]
