"""InternVL architecture: InternViT + pixel shuffle + MLP projector + Qwen2 / Qwen3 decoder.

Architecture only (parallelism, checkpoint I/O and training policy live elsewhere): no parallelism, no checkpoint I/O, no fused-qkv handling (the
state-dict adapter maps both transformers' and OpenGVLab's weights onto these modules). Forward
matches `transformers.InternVLForConditionalGeneration`.

* Images arrive as tiles: the processor cuts each image into up to `max_patches` 448 x 448 tiles
  (plus a thumbnail) and video frames into one tile each, all concatenated in placeholder order into
  `pixel_values` [num_tiles, 3, 448, 448]. Every tile becomes `tokens_per_tile` (256) features that
  replace the `<IMG_CONTEXT>` placeholders between `<img>` and `</img>`, in order.
* InternViT: CLS token + Conv2d patches + absolute positions (bicubic-resampled if a tile is not the
  configured size), pre-norm blocks (LayerNorm or RMSNorm) with per-channel layer scale on both
  residual branches, optional RMSNorm of q / k over the full width. The CLS token is dropped, the
  patch grid pixel-shuffled (0.5: 2 x 2 neighbouring patches -> one token of 4 x width), then
  LayerNorm -> Linear -> GELU -> Linear.
* Decoder: Qwen2 (qkv bias) or Qwen3 (QK-norm) from `models/common`, plain 1-D RoPE; positions
  count real tokens only (left padding shifts them, which RoPE's relative form makes immaterial),
  restart per sample when packed (`cu_seqlens`), and continue across `KVCache` decoding steps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.decoder import RotaryTextModel
from megatron_vlm.models.common.merge import merge_vision_embeddings
from megatron_vlm.models.common.mlp import MLP, SwiGLUMLP, get_activation
from megatron_vlm.models.common.norms import LayerNorm, RMSNorm
from megatron_vlm.models.common.rotary import rope_cos_sin
from megatron_vlm.models.common.vlm_base import KVCacheMixin, TextPositionsMixin, VLMBase
from megatron_vlm.models.internvl.args import InternVisionArgs, InternVLArgs, InternVLTextArgs, exported_hf_config


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[B, S, S, C] (patch rows, columns) -> [B, S/f, S/f, C*f*f]: the pixel shuffle of InternVL
    (ps_version v2, as in transformers): output (i, j) holds patch (f*i + a, f*j + b) at channel block
    a * f + b (row offset outer, column offset inner)."""
    b, s, s2, c = x.shape
    if s != s2 or s % factor:
        raise ValueError(f"pixel shuffle: the patch grid {s} x {s2} must be square and divisible by {factor}")
    x = x.view(b, s // factor, factor, s // factor, factor, c)  # rows (i, a), columns (j, b)
    x = x.permute(0, 1, 3, 2, 4, 5)  # [B, i, j, a, b, C]
    return x.reshape(b, s // factor, s // factor, factor * factor * c)


class InternVisionEmbeddings(nn.Module):
    def __init__(self, args: InternVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.cls_token = nn.Parameter(torch.zeros(1, 1, args.hidden_size))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, args.hidden_size)) if args.use_mask_token else None
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, args.patch_size, stride=args.patch_size)
        self.position_embedding = (
            nn.Parameter(torch.zeros(1, args.num_patches + 1, args.hidden_size))
            if args.use_absolute_position_embeddings else None
        )

    def _positions(self, height: int, width: int) -> torch.Tensor:
        table = self.position_embedding
        p = self.args.patch_size
        side = self.args.image_size // p
        if height == width == self.args.image_size:
            return table
        patch = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patch = F.interpolate(patch.float(), size=(height // p, width // p), mode="bicubic", align_corners=False)
        patch = patch.to(table.dtype).permute(0, 2, 3, 1).reshape(1, -1, table.shape[-1])
        return torch.cat([table[:, :1], patch], dim=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, 1 + (H/p)(W/p), hidden] (CLS first)."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.args.num_channels:
            raise ValueError(
                f"pixel_values must be [num_tiles, {self.args.num_channels}, H, W], got {tuple(pixel_values.shape)}"
            )
        _, _, height, width = pixel_values.shape
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if self.position_embedding is not None:
            x = x + self._positions(height, width).to(x.dtype)
        return x


class InternVisionLayer(nn.Module):
    """x + ls1 * attn(norm1(x)); x + ls2 * mlp(norm2(x)) (bidirectional, no rotary)."""

    def __init__(self, args: InternVisionArgs) -> None:
        super().__init__()
        h = args.hidden_size
        norm = LayerNorm if args.norm_type == "layer_norm" else RMSNorm
        self.norm1 = norm(h, eps=args.layer_norm_eps)
        self.attn = Attention(
            h, args.num_attention_heads, args.num_attention_heads, args.head_dim, qkv_bias=args.attention_bias,
            o_bias=True, causal=False, qk_norm_eps=args.qk_norm_eps if args.use_qk_norm else None, qk_norm_per_head=False,
        )
        self.ls1 = nn.Parameter(torch.full((h,), args.layer_scale_init_value))
        self.norm2 = norm(h, eps=args.layer_norm_eps)
        self.mlp = MLP(h, args.intermediate_size, activation=args.hidden_act)
        self.ls2 = nn.Parameter(torch.full((h,), args.layer_scale_init_value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1 * self.attn(self.norm1(x), None, None)
        return x + self.ls2 * self.mlp(self.norm2(x))


class InternVisionModel(nn.Module):
    def __init__(self, args: InternVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = InternVisionEmbeddings(args)
        self.layers = nn.ModuleList(InternVisionLayer(args) for _ in range(args.num_hidden_layers))
        self.layernorm = None if args.use_mean_pooling else LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, feature_layer: int = -1) -> torch.Tensor:
        """Hidden states [N, 1 + patches, hidden]: after the last layer (`feature_layer` -1, final LayerNorm
        included when configured) or hidden state `feature_layer` (0 = embeddings, i = after layer i)."""
        n = len(self.layers)
        stop = n if feature_layer == -1 else feature_layer % (n + 1)
        x = self.embeddings(pixel_values)
        for layer in self.layers[:stop]:
            x = layer(x)
        if feature_layer == -1 and self.layernorm is not None:
            x = self.layernorm(x)
        return x


class InternVLMultiModalProjector(nn.Module):
    """LayerNorm (eps 1e-5) -> Linear -> act -> Linear, from pixel-shuffled vision width to the LLM width."""

    def __init__(self, args: InternVLArgs) -> None:
        super().__init__()
        in_dim = args.vision.hidden_size * args.shuffle_factor**2
        self.layer_norm = LayerNorm(in_dim, eps=1e-5)
        self.linear_1 = nn.Linear(in_dim, args.text.hidden_size)
        self.act = get_activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.text.hidden_size, args.text.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLTextModel(RotaryTextModel):
    """Token embedding, Qwen2 / Qwen3 decoder layers (GQA; qkv bias or QK-norm), final RMSNorm."""

    args: InternVLTextArgs

    def _attention_kwargs(self) -> dict:
        a = self.args
        qwen3 = a.qk_norm
        return dict(qkv_bias=a.attention_bias, o_bias=a.attention_bias and qwen3,
                    qk_norm_eps=a.rms_norm_eps if qwen3 else None)

    def _mlp(self, layer_idx: int) -> nn.Module:
        return SwiGLUMLP(self.args.hidden_size, self.args.intermediate_size)

    def _cos_sin(self, position_ids):
        return rope_cos_sin(position_ids, self.args.head_dim, self.args.rope_theta)


class InternVLForConditionalGeneration(TextPositionsMixin, KVCacheMixin, VLMBase):
    """The full model: `vision_tower`, `multi_modal_projector`, `language_model`, `lm_head`."""

    _normal_init_types = (nn.Linear, nn.Embedding, nn.Conv2d)

    def __init__(self, args: InternVLArgs, hf_config: Optional[dict] = None) -> None:
        # config.json written on export: transformers' internvl layout (converted from internvl_chat)
        super().__init__(args, exported_hf_config(args, hf_config))
        self.vision_tower = InternVisionModel(args.vision)
        self.multi_modal_projector = InternVLMultiModalProjector(args)
        self.language_model = InternVLTextModel(args.text)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    def _vision_blocks(self) -> list[nn.Module]:
        return list(self.vision_tower.layers)

    def _init_module(self, module: nn.Module, std: float) -> None:
        """transformers' init beyond the generic one: zero CLS and position tables, layer scales at
        `layer_scale_init_value`."""
        if isinstance(module, InternVisionEmbeddings):
            for p in (module.cls_token, module.mask_token, module.position_embedding):
                if p is not None:
                    nn.init.zeros_(p)
        elif isinstance(module, InternVisionLayer):
            nn.init.constant_(module.ls1, self.args.vision.layer_scale_init_value)
            nn.init.constant_(module.ls2, self.args.vision.layer_scale_init_value)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, C, H, W] -> [tiles * tokens_per_tile, text hidden]: ViT, drop CLS, pixel shuffle, projector."""
        x = self.vision_tower(pixel_values, self.args.vision_feature_layer)[:, 1:]
        side = int(round(x.shape[1] ** 0.5))
        if side * side != x.shape[1]:
            raise ValueError(f"vision tower: {x.shape[1]} patch tokens per tile do not form a square grid")
        x = pixel_shuffle(x.reshape(x.shape[0], side, side, -1), self.args.shuffle_factor)
        x = self.multi_modal_projector(x.reshape(x.shape[0], -1, x.shape[-1]))
        return x.reshape(-1, x.shape[-1])

    # ----- forward (the template is VLMBase.forward) -----
    _takes = frozenset(VLMBase._takes | {"pixel_values"})

    def _embed(self, input_ids, cu_seqlens, inputs):
        """`pixel_values` [tiles, 3, H, W] holds the tiles of every image and every video frame of the batch, in
        placeholder order (InternVL's processor merges video frames into it)."""
        embeds = self.language_model.embed_tokens(input_ids)
        pixel_values = inputs.get("pixel_values")
        if pixel_values is not None:
            embeds = merge_vision_embeddings(
                embeds, input_ids, self.image_features(pixel_values), self.args.image_token_id, modality="image",
                features_per_item=[self.args.tokens_per_tile] * pixel_values.shape[0], cu_seqlens=cu_seqlens,
            )
        return embeds, {}
