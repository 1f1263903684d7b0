"""Text-only Qwen model arguments (`qwen2`, `qwen3`, `qwen3_moe`), built from a Hugging Face config.json.

The decoder settings are held in the VLM families' own text-args classes, because the decoder *is*
theirs: `qwen2` (Qwen2, Qwen2.5, Qwen2.5-Math) -> `Qwen2_5_VLTextArgs` (qkv bias, head_dim =
hidden / heads), `qwen3` / `qwen3_moe` -> `Qwen3VLTextArgs` (QK-norm, explicit head_dim, optional
MoE layers), each with `mrope_section = None`, which makes the shared decoder use 1-D RoPE.

Defaults where a key is absent follow transformers' config classes (`Qwen2Config`, `Qwen3Config`,
`Qwen3MoeConfig`): rope_theta 10000, rms_norm_eps 1e-6, Qwen3 head_dim 128 (Qwen3-MoE: hidden /
heads), `norm_topk_prob` False for Qwen3-MoE, untied embeddings. The structural sizes (vocab,
hidden, layers, heads, intermediate) are required: a config without them is not a real checkpoint.
Unsupported settings are errors naming the key: sliding-window attention (`use_sliding_window`, a
`layer_types` entry other than full_attention), a RoPE type other than default (YaRN etc.), an
activation other than SiLU, a Qwen2 `head_dim` other than hidden / heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from megatron_vlm.models.common.text_args import decoder_hf_fields
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLTextArgs
from megatron_vlm.models.qwen3_vl.args import Qwen3VLTextArgs

MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

TextArgs = Union[Qwen2_5_VLTextArgs, Qwen3VLTextArgs]


def _rope(cfg: dict) -> float:
    """rope_theta from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (4.x); only default RoPE."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only default RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _check_full_attention(cfg: dict) -> None:
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window = true: sliding-window attention is not supported")
    kinds = set(cfg.get("layer_types") or [])
    if kinds - {"full_attention"}:
        raise ValueError(f"config.json: layer_types {sorted(kinds)}: only full_attention layers are supported")


@dataclass(kw_only=True)
class QwenTextArgs:
    """A text-only Qwen causal LM: `text` (the shared decoder's args) + the LM head tie."""

    model_type: str = "qwen2"
    text: TextArgs = field(default_factory=lambda: Qwen2_5_VLTextArgs(mrope_section=None))
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return getattr(self.text, "num_experts", 0) > 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> QwenTextArgs:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        missing = [k for k in _REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json: {model_type} config lacks {', '.join(missing)}")
        _check_full_attention(cfg)
        kw: dict[str, Any] = {k: cfg[k] for k in _REQUIRED}
        kw["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        kw["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6)
        kw["max_position_embeddings"] = cfg.get("max_position_embeddings", 32768)
        kw["hidden_act"] = cfg.get("hidden_act", "silu")
        kw["rope_theta"] = _rope(cfg)
        if model_type == "qwen2":
            natural = cfg["hidden_size"] // cfg["num_attention_heads"]
            if cfg.get("head_dim") not in (None, natural):
                raise ValueError(f"config.json: qwen2 head_dim {cfg['head_dim']} != hidden_size / num_attention_heads "
                                 f"= {natural} is not supported")
            text: TextArgs = Qwen2_5_VLTextArgs(mrope_section=None, **kw)
        else:
            moe = model_type == "qwen3_moe"
            default_head_dim = cfg["hidden_size"] // cfg["num_attention_heads"] if moe else 128
            kw["head_dim"] = cfg.get("head_dim") or default_head_dim
            kw["attention_bias"] = bool(cfg.get("attention_bias", False))
            if moe:
                experts = cfg.get("num_experts", cfg.get("num_local_experts"))
                if not experts or cfg.get("num_experts_per_tok") is None or cfg.get("moe_intermediate_size") is None:
                    raise ValueError("config.json: qwen3_moe needs num_experts, num_experts_per_tok and moe_intermediate_size")
                kw.update(
                    num_experts=int(experts), num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                    mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
                )
            text = Qwen3VLTextArgs(mrope_section=None, **kw)
        args = cls(model_type=model_type, text=text, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        args.validate()
        return args

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"QwenTextArgs.model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        want = Qwen2_5_VLTextArgs if self.model_type == "qwen2" else Qwen3VLTextArgs
        if not isinstance(self.text, want):
            raise ValueError(f"QwenTextArgs: {self.model_type} needs {want.__name__} text args, got {type(self.text).__name__}")
        if self.text.mrope_section is not None:
            raise ValueError(f"QwenTextArgs: a text-only {self.model_type} decoder uses 1-D RoPE (mrope_section None)")
        if (self.model_type == "qwen3_moe") != self.is_moe:
            raise ValueError(f"model_type {self.model_type!r} but num_experts = {getattr(self.text, 'num_experts', 0)}")
        self.text.validate()

    def to_hf_config(self) -> dict:
        """A transformers >= 5 style config.json dict (used when the model was built from args, not a folder)."""
        t = self.text
        out = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            **decoder_hf_fields(t),
            "use_sliding_window": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        }
        if self.model_type != "qwen2":
            out.update(head_dim=t.head_dim, attention_bias=t.attention_bias)
        if self.is_moe:
            out.update(
                num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                moe_intermediate_size=t.moe_intermediate_size, decoder_sparse_step=t.decoder_sparse_step,
                mlp_only_layers=list(t.mlp_only_layers), norm_topk_prob=t.norm_topk_prob,
                router_aux_loss_coef=t.router_aux_loss_coef,
            )
        return out
