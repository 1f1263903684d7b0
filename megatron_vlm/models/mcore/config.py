"""The megatron-core `TransformerConfig` (and GPT model) matching a dense Qwen2 / Qwen3-style HF text
config, so a converted state dict (`convert.py`) loads into megatron-core's own modules.

Mapping (dense Qwen2 / Qwen3 and Qwen3-MoE): hidden_size, intermediate_size -> ffn_hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads -> num_query_groups, head_dim -> kv_channels, rms_norm_eps -> layernorm_epsilon,
SwiGLU (gated_linear_unit + silu), no linear biases except q/k/v for Qwen2 (add_qkv_bias), per-head
q/k RMSNorm for Qwen3 (qk_layernorm), rope_theta -> rotary_base, tie_word_embeddings ->
share_embeddings_and_output_weights. Text positions only: for the VL models' language decoders this is
M-RoPE with equal position components, which equals 1-D RoPE. megatron-core is imported on call.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["transformer_config_kwargs", "gpt_model_kwargs", "build_gpt_model"]

_TYPES = ("qwen2", "qwen3", "qwen3_moe")


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def transformer_config_kwargs(cfg) -> dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig for the HF text config `cfg`."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _TYPES:
        raise ValueError(f"megatron-core mapping: model_type {model_type!r} is not supported ({_TYPES} language "
                         "decoders only; Mamba2 hybrids are not mapped)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron-core mapping: hidden_act {cfg.hidden_act!r} (only SwiGLU / silu is mapped)")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        if getattr(cfg, "decoder_sparse_step", 1) != 1 or getattr(cfg, "mlp_only_layers", None):
            raise ValueError("megatron-core mapping: qwen3_moe with dense layers between MoE layers "
                             "(decoder_sparse_step != 1 or mlp_only_layers) is not mapped")
        # Qwen3-MoE routes by softmax over all experts, top-k, renormalised when norm_topk_prob: megatron-core's
        # softmax router takes the top-k logits then the softmax over them (the same numbers), or with
        # pre-softmax the softmax over all experts first (no renormalisation)
        moe = dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                   moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_pre_softmax=not cfg.norm_topk_prob,
                   moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                   moe_aux_loss_coeff=float(getattr(cfg, "router_aux_loss_coef", 0.0)))
    return dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type.startswith("qwen3"), hidden_dropout=0.0, attention_dropout=0.0, **moe,
    )


def gpt_model_kwargs(cfg) -> dict[str, Any]:
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
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=kwargs["qk_layernorm"],
                                    num_experts=kwargs.get("num_moe_experts"), moe_grouped_gemm=False)
    return GPTModel(config, spec, **gpt_model_kwargs(cfg))
