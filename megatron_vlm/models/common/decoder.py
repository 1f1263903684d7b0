"""Pre-norm transformer decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); and the rotary language model
built from it (`RotaryTextModel`: embedding, layers, final norm).

The layout of Qwen2 / Qwen2.5-VL / Qwen3 / InternVL's LLM (names follow transformers:
`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`; `embed_tokens`, `layers`, `norm`). The MLP
is passed in so a family can use a dense SwiGLU or a MoE block.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.deepstack import add_deepstack
from megatron_vlm.models.common.norms import RMSNorm
from megatron_vlm.models.common.vlm_base import cu_seqlens_max


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, self_attn: Attention, mlp: nn.Module, norm_eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attention_kwargs: Any) -> torch.Tensor:
        """x [B, S, hidden] or packed [T, hidden]; `attention_kwargs` are `Attention.forward`'s (cu_seqlens,
        max_seqlen, key_padding_mask, kv_cache, layer_idx, prefix_layout)."""
        attn_out = self.self_attn(self.input_layernorm(x), cos, sin, **attention_kwargs)
        # fused residual add + norm: h = x + attn_out, normed = rms_norm(h)
        normed, x = self.post_attention_layernorm(attn_out, residual=x)
        return x + self.mlp(normed)


def run_rotary_decoder(
    layers,
    norm: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    kv_cache=None,
    prefix_layout=None,
    after_layer: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
) -> torch.Tensor:
    """The layer loop of the rotary decoders (Qwen2 / Qwen3 / InternVL's LLM): x [B, T, H] through `layers`
    (`after_layer(x, i)` after layer i: DeepStack) and the final `norm`; packed input drops the batch dim for
    the loop (attention segmented by `cu_seqlens`) and gets it back at the end."""
    max_seqlen = None
    if cu_seqlens is not None:  # packed: drop the batch dim, attention is segmented by cu_seqlens
        x, cos, sin = x[0], cos[0], sin[0]
        max_seqlen = cu_seqlens_max(cu_seqlens)
    for i, layer in enumerate(layers):
        x = layer(
            x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            key_padding_mask=key_padding_mask, kv_cache=kv_cache, layer_idx=i, prefix_layout=prefix_layout,
        )
        if after_layer is not None:
            x = after_layer(x, i)
    x = norm(x)
    return x.unsqueeze(0) if cu_seqlens is not None else x


class RotaryTextModel(nn.Module):
    """Token embedding, `DecoderLayer`s (GQA attention + the family's MLP), final RMSNorm: the language model of
    Qwen2 / Qwen2.5-VL, Qwen3(-VL, -MoE) and InternVL. A family says what differs through three hooks:
    `_attention_kwargs()` (qkv / o bias, QK-norm), `_mlp(i)` (dense or MoE block of layer i) and
    `_cos_sin(position_ids)` (M-RoPE, interleaved M-RoPE or 1-D RoPE tables)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                args.hidden_size,
                Attention(
                    args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, causal=True,
                    **self._attention_kwargs(),
                ),
                self._mlp(i),
                args.rms_norm_eps,
            )
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def _attention_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def _mlp(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def _cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        visual_index: Optional[torch.Tensor] = None,
        deepstack_embeds: Optional[list[torch.Tensor]] = None,
        **decoder_kwargs: Any,
    ) -> torch.Tensor:
        """inputs_embeds [B, T, H], position_ids ([3, B, T] M-RoPE or [B, T] 1-D RoPE, as `_cos_sin` takes)
        -> final-norm hidden states [B, T, H]; `decoder_kwargs` are `run_rotary_decoder`'s (key_padding_mask,
        cu_seqlens, kv_cache, prefix_layout).

        DeepStack (Qwen3-VL): after layer j < len(deepstack_embeds), `deepstack_embeds[j]` [n, H] is added at
        the flattened token positions `visual_index` [n] (row-major over [B, T])."""
        cos, sin = self._cos_sin(position_ids)
        return run_rotary_decoder(
            self.layers, self.norm, inputs_embeds, cos, sin, **decoder_kwargs,
            after_layer=(lambda x, i: add_deepstack(x, i, visual_index, deepstack_embeds)) if deepstack_embeds else None,
        )
