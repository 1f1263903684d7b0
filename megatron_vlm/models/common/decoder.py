"""Pre-norm transformer decoder layer: x + attn(norm(x)), then x + mlp(norm(x)).

The layout of Qwen2 / Qwen2.5-VL / Qwen3 / InternVL's LLM (names follow transformers:
`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`). The MLP is passed in so a family
can use a dense SwiGLU or a MoE block.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, self_attn: Attention, mlp: nn.Module, norm_eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        kv_cache=None,
        layer_idx: Optional[int] = None,
        prefix_layout=None,
    ) -> torch.Tensor:
        attn_out = self.self_attn(
            self.input_layernorm(x),
            cos,
            sin,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            key_padding_mask=key_padding_mask,
            kv_cache=kv_cache,
            layer_idx=layer_idx,
            prefix_layout=prefix_layout,
        )
        # fused residual add + norm: h = x + attn_out, normed = rms_norm(h)
        normed, x = self.post_attention_layernorm(attn_out, residual=x)
        return x + self.mlp(normed)
