"""Qwen3-VL architecture: ViT with DeepStack + 2x2 patch merger + Qwen3 (or Qwen3-MoE) decoder with
interleaved M-RoPE.

Architecture only (parallelism, checkpoint I/O and training policy live elsewhere): no parallelism, no checkpoint I/O, no fused-qkv handling (the
state-dict adapter maps transformers' weights onto these modules). Forward matches
`transformers.Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` given
`mm_token_type_ids`; here the 3-D positions are derived from `input_ids` and the grids whether or
not `mm_token_type_ids` is passed.

What differs from Qwen2.5-VL:
* vision tower: Conv3d patch embed with bias, a learned square position table (side x side)
  resampled bilinearly (align_corners) to every image's patch grid, LayerNorm blocks with a plain
  GELU(tanh) MLP, full attention inside each frame (no windows);
* DeepStack: the hidden states after the vision blocks `deepstack_visual_indexes[j]` go through
  their own merger (LayerNorm after the 2x2 shuffle) and are added to the decoder's hidden states at
  the vision placeholder positions after decoder layer j;
* decoder: Qwen3 (no qkv bias, per-head RMSNorm of q and k, explicit head_dim); M-RoPE frequencies
  interleaved t/h/w; MoE layers (`MoE` from `models/common/moe.py`, softmax top-k, renormalised);
* positions: every video frame (temporal patch) is its own placeholder run, preceded by a
  `<t seconds>` text timestamp, with temporal position = the run's start (time is carried by the
  timestamp text, not by `second_per_grid_ts`, which is accepted and unused).

Input forms of `forward` are those of Qwen2.5-VL: padded batch (+ attention_mask, left or right
padding), packed (input_ids [1, T] + `cu_seqlens`; positions restart per sample), decoding with a
`KVCache` (positions continue from the prefill's per-sample `rope_deltas`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.host_copies import move, on_host
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.decoder import RotaryTextModel
from megatron_vlm.models.common.mlp import MLP, SwiGLUMLP
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.norms import LayerNorm
from megatron_vlm.models.common.rotary import decoder_rope_cos_sin, vision_rope_cos_sin
from megatron_vlm.models.common.vision import VisionPatchEmbed, vision_cu_seqlens, vision_hw_position_ids
from megatron_vlm.models.common.vlm_base import QwenVLBase, cu_seqlens_max
from megatron_vlm.models.qwen3_vl.args import Qwen3VLTextArgs, Qwen3VLVisionArgs


def split_video_grids(video_grid_thw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[t, h, w] per video -> t rows of [1, h, w]: Qwen3-VL places each temporal patch in its own run."""
    if video_grid_thw is None:
        return None
    grids = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0).clone()
    grids[:, 0] = 1
    return grids


class Qwen3VLVisionBlock(nn.Module):
    """Pre-norm ViT block: LayerNorm -> bidirectional attention (2-D rotary, per-frame cu_seqlens) ->
    residual -> LayerNorm -> fc1 / GELU(tanh) / fc2 -> residual."""

    def __init__(self, args: Qwen3VLVisionArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.norm1 = LayerNorm(h, eps=args.norm_eps)
        self.attn = Attention(h, args.num_heads, args.num_heads, args.head_dim, qkv_bias=True, o_bias=True, causal=False)
        self.norm2 = LayerNorm(h, eps=args.norm_eps)
        self.mlp = MLP(h, args.intermediate_size, activation=args.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionPatchMerger(nn.Module):
    """2x2 patch merge -> Linear -> GELU -> Linear. The main merger normalises each patch before the
    shuffle (LayerNorm over hidden); the DeepStack mergers normalise after it (over 4 x hidden).
    (Class name as in transformers, so `train.train_layers = ["Qwen3VLVisionPatchMerger"]` works.)"""

    def __init__(self, args: Qwen3VLVisionArgs, *, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_dim = args.hidden_size * args.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.merged_dim if postshuffle_norm else args.hidden_size, eps=args.norm_eps)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, args: Qwen3VLVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = VisionPatchEmbed(
            args.in_channels, args.temporal_patch_size, args.patch_size, args.hidden_size, bias=True
        )
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(args) for _ in range(args.depth))
        self.merger = Qwen3VLVisionPatchMerger(args, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLVisionPatchMerger(args, postshuffle_norm=True) for _ in args.deepstack_visual_indexes
        )

    def position_embeddings(self, grid_thw: torch.Tensor, hw_position_ids: torch.Tensor) -> torch.Tensor:
        """The side x side table resampled (bilinear, align_corners) to each item's h x w grid, read at
        every patch's (row, column): [N, hidden]. Frames of a video share their item's table."""
        side = self.args.num_grid_per_side
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0)  # [1, C, side, side]
        resampled: dict[tuple[int, int], torch.Tensor] = {}
        pieces, offset = [], 0
        for t, h, w in on_host(grid_thw).tolist():
            if (h, w) not in resampled:
                grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)
                resampled[(h, w)] = grid[0].permute(1, 2, 0)  # [h, w, C]
            n = t * h * w
            rows, cols = hw_position_ids[offset : offset + n].unbind(-1)
            pieces.append(resampled[(h, w)][rows, cols])
            offset += n
        return torch.cat(pieces, dim=0)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N_patches, C*T*P*P], grid_thw [items, 3] ->
        (merged features [N / m^2, out_hidden], DeepStack features: one [N / m^2, out_hidden] per index)."""
        a = self.args
        x = self.patch_embed(pixel_values)
        cu = move(vision_cu_seqlens(grid_thw), x.device)  # keeps its host copy: no sync for its bounds
        patches = int(on_host(cu)[-1])
        if x.shape[0] != patches:
            raise ValueError(
                f"vision tower: pixel_values has {x.shape[0]} patches but grid_thw {on_host(grid_thw).tolist()} "
                f"describes {patches}"
            )
        hw = vision_hw_position_ids(grid_thw, a.spatial_merge_size).to(x.device, non_blocking=True)
        x = x + self.position_embeddings(grid_thw, hw).to(x.dtype)
        cos, sin = vision_rope_cos_sin(hw, a.head_dim, a.rope_theta)
        max_seqlen = cu_seqlens_max(cu)
        deepstack = []  # in block order (as transformers), each through the merger of its list position
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu, max_seqlen)
            if i in a.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[a.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


def _moe_block(args: Qwen3VLTextArgs) -> MoE:
    """Qwen3-MoE sparse block: softmax router, top-k (renormalised when `norm_topk_prob`: always for
    Qwen3-VL-MoE, per config.json for text-only Qwen3-MoE), SwiGLU experts, no shared experts."""
    return MoE(
        args.hidden_size,
        num_experts=args.num_experts,
        top_k=args.num_experts_per_tok,
        moe_intermediate_size=args.moe_intermediate_size,
        activation=args.hidden_act,
        gated_experts=True,
        score_func="softmax",
        norm_topk_prob=args.norm_topk_prob,
        score_correction_bias=False,
    )


class Qwen3VLTextModel(RotaryTextModel):
    """Token embedding, Qwen3 decoder layers (GQA, QK-norm, dense or MoE MLP), final RMSNorm; DeepStack
    features added after the first layers.

    Also the decoder of text-only Qwen3 / Qwen3-MoE (`models/qwen_text`): with `args.mrope_section`
    None the rotary is plain 1-D RoPE over position_ids [B, T] (and no DeepStack input is given)."""

    args: Qwen3VLTextArgs

    def _attention_kwargs(self) -> dict:
        a = self.args
        return dict(qkv_bias=a.attention_bias, o_bias=a.attention_bias, qk_norm_eps=a.rms_norm_eps)

    def _mlp(self, layer_idx: int) -> nn.Module:
        a = self.args
        return _moe_block(a) if a.is_moe_layer(layer_idx) else SwiGLUMLP(a.hidden_size, a.intermediate_size)

    def _cos_sin(self, position_ids):
        a = self.args
        return decoder_rope_cos_sin(position_ids, a.head_dim, a.rope_theta, a.mrope_section, interleaved=True)


class Qwen3VLForConditionalGeneration(QwenVLBase):
    """The full model: `visual` (ViT with DeepStack mergers), `language_model` (dense or MoE), `lm_head`
    (models/common/vlm_base.py). Qwen3-VL reads time from the `<t seconds>` text before every frame:
    `second_per_grid_ts`, taken for a uniform call signature across the Qwen-VL families, is ignored."""

    _vision_cls = Qwen3VLVisionModel
    _text_cls = Qwen3VLTextModel
    _deepstack = True
    _takes = QwenVLBase._takes - {"second_per_grid_ts"}
    _ignores = frozenset({"second_per_grid_ts"})

    def _init_module(self, module: nn.Module, std: float) -> None:
        if isinstance(module, MoE):  # expert weights are Parameters of the MoE block, not Linear modules
            module.reset_parameters(std)

    def _tokens_per_second(self) -> float:
        return 1.0  # unused: every run has one temporal patch, at temporal offset 0

    def _video_grids(self, video_grid_thw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return split_video_grids(video_grid_thw)  # one run of placeholders per frame
