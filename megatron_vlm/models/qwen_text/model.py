"""Text-only Qwen causal LMs (Qwen2 / Qwen2.5 / Qwen2.5-Math, Qwen3, Qwen3-MoE) on the VLMs' decoder.

Architecture only. The decoder is not re-implemented here: `language_model` is the Qwen2.5-VL
family's `Qwen2_5_VLTextModel` (qwen2) or the Qwen3-VL family's `Qwen3VLTextModel` (qwen3,
qwen3_moe), built with `mrope_section = None` so its rotary is 1-D RoPE. Attention, MLP / MoE,
norms, kernels, KV cache, FSDP / AC units and expert parallelism are therefore the VLMs' own.
Forward matches `transformers.Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`.

`forward` takes the VLMs' batch schema (`data.batch.MODEL_INPUT_KEYS`) so the trainer, the
evaluators and the rollout engine call it unchanged: the vision inputs must be absent (an error
otherwise), `mm_token_type_ids` / `second_per_grid_ts` are accepted and unused. Input forms: padded
batch (+ attention_mask, left or right padding: positions count real tokens), packed (input_ids
[1, T] + `cu_seqlens`; positions restart per sample), decoding with a `KVCache` from `new_cache`
(positions continue after the cached real tokens). See `models/common/text_positions.py`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.prefix_sharing import prefix_layout_and_positions
from megatron_vlm.models.common.text_positions import text_position_ids
from megatron_vlm.models.common.vlm_base import KVCacheMixin, VLMBase, check_forward_inputs, new_tokens_mask
from megatron_vlm.models.qwen2_5_vl.model import Qwen2_5_VLTextModel
from megatron_vlm.models.qwen3_vl.model import Qwen3VLTextModel
from megatron_vlm.models.qwen_text.args import QwenTextArgs

_VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class QwenTextForCausalLM(KVCacheMixin, VLMBase):
    """`language_model` (the shared Qwen decoder), `lm_head` (shares the embedding Parameter when tied)."""

    def __init__(self, args: QwenTextArgs, hf_config: Optional[dict] = None) -> None:
        super().__init__(args, hf_config)
        decoder = Qwen2_5_VLTextModel if args.model_type == "qwen2" else Qwen3VLTextModel
        self.language_model = decoder(args.text)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    def _init_module(self, module: nn.Module, std: float) -> None:
        if isinstance(module, MoE):  # expert weights are Parameters of the MoE block, not Linear modules
            module.reset_parameters(std)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_thw: Optional[torch.Tensor] = None,
        pixel_values_videos: Optional[torch.Tensor] = None,
        video_grid_thw: Optional[torch.Tensor] = None,
        second_per_grid_ts: Optional[torch.Tensor] = None,
        mm_token_type_ids: Optional[torch.Tensor] = None,
        *,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        kv_cache=None,
        return_hidden: bool = False,
        prefix_segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or final-norm hidden states [B, T, H] with `return_hidden=True`).

        `position_ids` [B, T] overrides the derived positions ([3, B, T] is accepted, its first row used).
        `prefix_segments` (packed input): a prompt shared by several segments (models/common/prefix_sharing.py)."""
        del second_per_grid_ts, mm_token_type_ids
        given = [name for name, t in zip(_VISION_INPUTS, (pixel_values, image_grid_thw, pixel_values_videos,
                                                          video_grid_thw)) if t is not None]
        if given:
            raise ValueError(f"{self.args.model_type} is a text-only model: got vision inputs {given}")
        cu_seqlens = check_forward_inputs(input_ids, attention_mask, cu_seqlens, kv_cache)
        embeds = self.language_model.embed_tokens(input_ids)
        key_padding_mask = attention_mask.bool() if attention_mask is not None else None
        if kv_cache is not None:
            new_mask = new_tokens_mask(key_padding_mask, input_ids)
            if position_ids is None:
                position_ids = text_position_ids(input_ids, attention_mask=new_mask, kv_cache=kv_cache)
            kv_cache.begin_step(input_ids.shape[1], new_mask)
            key_padding_mask = None  # the cache supplies the mask over all cached keys
        elif position_ids is None:
            position_ids = text_position_ids(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        if position_ids.dim() == 3:
            position_ids = position_ids[0]
        position_ids, prefix_layout = prefix_layout_and_positions(position_ids, cu_seqlens, prefix_segments)
        hidden = self.language_model(
            embeds, position_ids, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, kv_cache=kv_cache,
            prefix_layout=prefix_layout,
        )
        if kv_cache is not None:
            kv_cache.end_step()
        if return_hidden:
            return hidden
        return self.lm_head(hidden)
