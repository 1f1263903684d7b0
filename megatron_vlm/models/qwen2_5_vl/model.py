"""Qwen2.5-VL architecture: window-attention ViT + 2x2 patch merger + Qwen2 decoder with M-RoPE.

Architecture only (parallelism, checkpoint I/O and training policy live elsewhere): no parallelism, no checkpoint I/O, no fused-qkv handling (the
state-dict adapter maps transformers' weights onto these modules). Forward matches
`transformers.Qwen2_5_VLForConditionalGeneration` given `mm_token_type_ids`; here the 3-D positions
are derived from `input_ids` and the grids whether or not `mm_token_type_ids` is passed. After a video,
the text resumes at the video's largest position + 1 (the original Qwen2.5-VL rule, vLLM's; transformers
5.3+ differ there: models/common/mrope_index.py).

Input forms of `forward`:
* padded batch: input_ids [B, T] (+ attention_mask [B, T], left or right padding);
* packed: input_ids [1, T] + `cu_seqlens` int32 [n + 1]; positions restart per sample and no token
  attends across samples; images / videos of all samples are concatenated in order;
* decoding: `kv_cache` (a `KVCache`): the new tokens attend to the cached ones and continue each
  sample's M-RoPE positions from the prefill's `rope_deltas`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.host_copies import move, on_host
from megatron_vlm.models.common.decoder import RotaryTextModel
from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.norms import RMSNorm
from megatron_vlm.models.common.rotary import decoder_rope_cos_sin, vision_rope_cos_sin
from megatron_vlm.models.common.vision import (
    VisionBlock,
    VisionPatchEmbed,
    vision_cu_seqlens,
    vision_hw_position_ids,
    vision_window_index,
)
from megatron_vlm.models.common.vlm_base import QwenVLBase, cu_seqlens_max
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLTextArgs, Qwen2_5_VLVisionArgs


class Qwen2_5_VLPatchMerger(nn.Module):
    """RMSNorm, then each 2x2 block of patches (consecutive rows) -> Linear -> GELU -> Linear."""

    def __init__(self, out_hidden_size: int, context_dim: int, spatial_merge_size: int, norm_eps: float) -> None:
        super().__init__()
        self.merged_dim = context_dim * spatial_merge_size**2
        self.ln_q = RMSNorm(context_dim, eps=norm_eps)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.merged_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, args: Qwen2_5_VLVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = VisionPatchEmbed(args.in_channels, args.temporal_patch_size, args.patch_size, args.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(args.hidden_size, args.num_heads, args.intermediate_size, args.norm_eps) for _ in range(args.depth)
        )
        self.merger = Qwen2_5_VLPatchMerger(args.out_hidden_size, args.hidden_size, args.spatial_merge_size, args.norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N_patches, C*T*P*P], grid_thw [items, 3] -> merged features [N_patches / m^2, out_hidden]."""
        a = self.args
        unit = a.spatial_merge_size**2
        x = self.patch_embed(pixel_values)
        cu_full = move(vision_cu_seqlens(grid_thw), x.device)  # index tensors keep their host copies: no sync
        patches = int(on_host(cu_full)[-1])
        if x.shape[0] != patches:
            raise ValueError(
                f"vision tower: pixel_values has {x.shape[0]} patches but grid_thw {on_host(grid_thw).tolist()} "
                f"describes {patches}"
            )
        window_index, cu_window = vision_window_index(grid_thw, a.spatial_merge_size, a.window_size, a.patch_size)
        window_index, cu_window = window_index.to(x.device, non_blocking=True), move(cu_window, x.device)
        # window order is defined on merged tokens; expand to their m^2 consecutive patches
        patch_perm = (window_index[:, None] * unit + torch.arange(unit, device=x.device)).reshape(-1)
        hw = vision_hw_position_ids(grid_thw, a.spatial_merge_size).to(x.device, non_blocking=True)
        cos, sin = vision_rope_cos_sin(hw, a.head_dim, a.rope_theta)
        x, cos, sin = x[patch_perm], cos[patch_perm], sin[patch_perm]
        full_max, window_max = cu_seqlens_max(cu_full), cu_seqlens_max(cu_window)
        fullatt = set(a.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            if i in fullatt:
                x = block(x, cos, sin, cu_full, full_max)
            else:
                x = block(x, cos, sin, cu_window, window_max)
        merged = self.merger(x)
        return merged[torch.argsort(window_index)]


class Qwen2_5_VLTextModel(RotaryTextModel):
    """Token embedding, Qwen2 decoder layers (GQA, qkv bias, M-RoPE), final RMSNorm.

    Also the decoder of text-only Qwen2 / Qwen2.5(-Math) (`models/qwen_text`): with
    `args.mrope_section` None the rotary is plain 1-D RoPE over position_ids [B, T]."""

    args: Qwen2_5_VLTextArgs

    def _attention_kwargs(self) -> dict:
        return dict(qkv_bias=True, o_bias=False)

    def _mlp(self, layer_idx: int) -> nn.Module:
        return SwiGLUMLP(self.args.hidden_size, self.args.intermediate_size, bias=False)

    def _cos_sin(self, position_ids):
        a = self.args
        return decoder_rope_cos_sin(position_ids, a.head_dim, a.rope_theta, a.mrope_section)  # [B, T, D]


class Qwen2_5_VLForConditionalGeneration(QwenVLBase):
    """The full model: `visual` (window-attention ViT), `language_model`, `lm_head` (models/common/vlm_base.py)."""

    _vision_cls = Qwen2_5_VisionTransformer
    _text_cls = Qwen2_5_VLTextModel
