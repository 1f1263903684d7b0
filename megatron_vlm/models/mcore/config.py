"""The megatron-core `TransformerConfig` (and GPT model) matching a dense Qwen2 / Qwen3-style HF text
config, so a converted state dict (`convert.py`) loads into megatron-core's own modules.

Mapping: hidden_size, intermediate_size -> ffn_hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads -> num_query_groups, head_dim -> kv_channels, rms_norm_eps -> layernorm_epsilon,
SwiGLU (gated_linear_unit + silu), no linear biases except q/k/v for Qwen2 (add_qkv_bias), per-head
q/k RMSNorm for Qwen3 (qk_layernorm), rope_theta -> rotary_base, tie_word_embeddings ->
share_embeddings_and_output_weights. Text positions only: for the VL models' language decoders this is
M-RoPE with equal position components, which equals 1-D RoPE. megatron-core is imported on call.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["transformer_config_kwargs", "gpt_model_kwargs", "build_gpt_model"]

_DENSE_TYPES = ("qwen2", "qwen3")


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def transformer_config_kwargs(cfg) -> Dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig for the HF text config `cfg`."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _DENSE_TYPES:
        raise ValueError(f"megatron-core mapping: model_type {model_type!r} is not supported (dense {_DENSE_TYPES} "
                         "language decoders only; MoE and Mamba2 hybrids are not mapped)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron-core mapping: hidden_act {cfg.hidden_act!r} (only SwiGLU / silu is mapped)")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3", hidden_dropout=0.0, attention_dropout=0.0,
    )


def gpt_model_kwargs(cfg) -> Dict[str, Any]:
    """Keyword arguments of megatron-core's GPTModel (besides config and layer spec)."""
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="rope", rotary_base=_rope_theta(cfg),
                share_embeddings_and_output_weights=bool(getattr(cfg, "tie_word_embeddings", False)))


def build_gpt_model(cfg, *, dtype: torch.dtype = torch.float32, **config_overrides):
    """megatron-core GPTModel with the local layer spec (no Transformer Engine needed) for `cfg`; the
    caller initialises torch.distributed and megatron-core's parallel state first."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(cfg)
    kwargs.update(params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True, **config_overrides)
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=kwargs["qk_layernorm"])
    return GPTModel(config, spec, **gpt_model_kwargs(cfg))
