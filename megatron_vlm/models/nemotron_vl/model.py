"""Nemotron-H hybrid language model and the Nemotron-3-Nano-VL vision-language model.

Architecture only (no parallelism, checkpoint I/O or training policy). The decoder is transformers' `NemotronHModel`: a stack of
pre-norm residual blocks `x + mixer(RMSNorm(x))` whose mixer is, per `layers_block_type`, a Mamba2
mixer ("linear_attention"), grouped-query attention without positional encoding
("full_attention"), a relu^2 MLP ("mlp") or a MoE with sigmoid routing and one shared expert
("moe"); then `norm_f` and `lm_head`. The VLM adds the RADIO encoder, pixel shuffle and projector
(vision.py) whose outputs replace the image placeholder tokens (`merge_vision_embeddings`).

Qwen3-VL vision variant (`vision_config.model_type` "qwen3_vl", see args.py): `vision_model` is the
Qwen3-VL family's own `Qwen3VLVisionModel` (ViT + `Qwen3VLVisionPatchMerger`, reused from
`models/qwen3_vl/model.py`); inputs are Qwen3-VL's (`pixel_values` + `image_grid_thw`,
`pixel_values_videos` + `video_grid_thw`, placeholders `image_token_id` / `video_token_id`). Its
DeepStack features (one per `deepstack_visual_indexes` entry) are added to the decoder's hidden
states at the vision placeholder positions after decoder blocks 0 .. len(deepstack) - 1, as
Qwen3-VL's text model does; here those blocks are hybrid blocks of any kind (Mamba2, MoE ...).

Input forms of `forward` (the Qwen2.5-VL family's API):
* padded batch: input_ids [B, T] (+ attention_mask [B, T], left or right padding): padding is
  masked out of attention and zeroed in the Mamba mixers, so it never changes real tokens;
* packed: input_ids [1, T] + `cu_seqlens`: attention and the Mamba scans restart per sample;
* decoding: `kv_cache` = `model.new_cache(batch_size, max_len)` (KV for attention layers, conv + SSM
  state for Mamba layers): prefill, then one or more tokens per call.
Nemotron-H has no positional encoding (position is carried by the Mamba layers), so
`position_ids` is accepted for API compatibility and has no effect.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.host_copies import keep_host_copy, on_host
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.deepstack import add_deepstack
from megatron_vlm.models.common.mamba2 import Mamba2Mixer
from megatron_vlm.models.common.merge import VISION_INPUTS, embed_vision_inputs, merge_vision_embeddings
from megatron_vlm.models.common.moe import MoE, activation_fn
from megatron_vlm.models.common.norms import RMSNorm
from megatron_vlm.models.common.vlm_base import VLMBase, cu_seqlens_max, new_tokens_mask
from megatron_vlm.models.nemotron_vl.args import NemotronHTextArgs, NemotronVLArgs
from megatron_vlm.models.nemotron_vl.cache import HybridCache
from megatron_vlm.models.nemotron_vl.vision import (
    LayerNorm,
    NemotronVLProjector,
    RadioEmbeddings,
    RadioLayerScale,
    RadioVisionModel,
    shuffle_and_project,
)
from megatron_vlm.models.qwen3_vl.model import Qwen3VLVisionModel


def _with_frames(grid_hw: torch.Tensor) -> torch.Tensor:
    """[n, 2] image grids as [n, 3] (t = 1)."""
    return torch.cat([torch.ones_like(grid_hw[:, :1]), grid_hw], dim=1)


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(x))) - not gated (relu^2 in Nemotron-H); also the MoE shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHBlock(nn.Module):
    def __init__(self, args: NemotronHTextArgs, layer_idx: int) -> None:
        super().__init__()
        a = args
        self.block_type = a.layers_block_type[layer_idx]
        self.norm = RMSNorm(a.hidden_size, eps=a.layer_norm_epsilon)
        if self.block_type == "linear_attention":
            self.mixer = Mamba2Mixer(
                a.hidden_size, num_heads=a.mamba_num_heads, head_dim=a.mamba_head_dim, state_size=a.ssm_state_size,
                n_groups=a.n_groups, conv_kernel=a.conv_kernel, chunk_size=a.chunk_size,
                use_conv_bias=a.use_conv_bias, use_bias=a.use_bias, norm_eps=a.layer_norm_epsilon,
                time_step_min=a.time_step_min, time_step_max=a.time_step_max, time_step_floor=a.time_step_floor,
            )
        elif self.block_type == "full_attention":
            self.mixer = Attention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, qkv_bias=False, o_bias=False, causal=True
            )
        elif self.block_type == "mlp":
            self.mixer = NemotronHMLP(a.hidden_size, a.intermediate_size, a.mlp_hidden_act, a.mlp_bias)
        else:
            self.mixer = MoE(
                a.hidden_size, num_experts=a.n_routed_experts, top_k=a.num_experts_per_tok,
                moe_intermediate_size=a.moe_intermediate_size, activation=a.mlp_hidden_act, gated_experts=False,
                score_func="sigmoid", n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                routed_scaling_factor=a.routed_scaling_factor, score_correction_bias=True, fp32_weight=True,
                shared_experts=NemotronHMLP(a.hidden_size, a.moe_shared_expert_intermediate_size, a.mlp_hidden_act, a.mlp_bias),
                latent_size=a.moe_latent_size, latent_bias=a.mlp_bias,
            )

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        cache: Optional[HybridCache] = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        """x [B, T, hidden] (packed: B = 1 with cu_seqlens); attention_mask [B, T] of real tokens."""
        h = self.norm(x)
        if self.block_type == "linear_attention":
            state = None if cache is None else cache.mamba_state(layer_idx)
            h = self.mixer(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens, state=state)
        elif self.block_type == "full_attention":  # no positional encoding: cos / sin None skip the rotary
            if cu_seqlens is not None:
                h = self.mixer(h[0], None, None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen).unsqueeze(0)
            elif cache is not None:
                h = self.mixer(h, None, None, kv_cache=cache.kv, layer_idx=cache.kv_index(layer_idx))
            else:
                mask = None if attention_mask is None else attention_mask.bool()
                h = self.mixer(h, None, None, key_padding_mask=mask)
        elif self.block_type == "moe":
            h = self.mixer(h, token_mask=attention_mask)
        else:
            h = self.mixer(h)
        return x + h


class NemotronHTextModel(nn.Module):
    """Token embedding, the hybrid blocks, final RMSNorm (transformers' NemotronHModel)."""

    def __init__(self, args: NemotronHTextArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm_f = RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[HybridCache] = None,
        visual_index: Optional[torch.Tensor] = None,
        deepstack_embeds: Optional[list[torch.Tensor]] = None,
    ) -> torch.Tensor:
        """DeepStack: after block j < len(deepstack_embeds), `deepstack_embeds[j]` [n, H] is added at the
        flattened token positions `visual_index` [n] (row-major over [B, T])."""
        x = inputs_embeds
        max_seqlen = cu_seqlens_max(cu_seqlens) if cu_seqlens is not None else None
        if deepstack_embeds and len(deepstack_embeds) > len(self.layers):
            raise ValueError(f"{len(deepstack_embeds)} DeepStack feature levels but only {len(self.layers)} decoder blocks")
        for i, layer in enumerate(self.layers):
            x = layer(x, attention_mask=attention_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cache=cache, layer_idx=i)
            x = add_deepstack(x, i, visual_index, deepstack_embeds)
        return self.norm_f(x)


class NemotronVLForConditionalGeneration(VLMBase):
    """`language_model` + `lm_head`, and for nemotron_h_omni `vision_model` + `multi_modal_projector`
    (RADIO) or `vision_model` alone (the Qwen3-VL tower, whose patch merger is the projector).

    Decoding state comes from `new_cache` (a `HybridCache`: KV for attention layers + Mamba states)."""

    def __init__(self, args: NemotronVLArgs, hf_config: Optional[dict] = None) -> None:
        super().__init__(args, hf_config)
        self.language_model = NemotronHTextModel(args.text)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)
        if args.vision_tower == "qwen3_vl":
            self.vision_model = Qwen3VLVisionModel(args.vision)
            self.vision_final_layernorm = self.multi_modal_projector = None
        elif args.vision is not None:
            v = args.vision
            self.vision_model = RadioVisionModel(v)
            # Megatron-Core checkpoints with MTP layers carry a final LayerNorm on the vision features.
            self.vision_final_layernorm = (
                LayerNorm(args.vision_hidden_size, v.layer_norm_eps) if args.text.num_nextn_predict_layers > 0 else None
            )
            self.multi_modal_projector = NemotronVLProjector(
                args.vision_hidden_size * args.merge_size**2, args.projector_hidden_size, args.text.hidden_size
            )
        else:
            self.vision_model = self.vision_final_layernorm = self.multi_modal_projector = None
        self.tie_weights()

    # ----- structure helpers used by parallelize / loading / training -----
    def _input_embeddings(self) -> nn.Embedding:
        return self.language_model.embeddings

    def _vision_blocks(self) -> list[nn.Module]:
        if self.vision_model is None:
            return []
        return list(self.vision_model.blocks if self.args.vision_tower == "qwen3_vl" else self.vision_model.layers)

    def new_cache(self, batch_size: int, max_len: int, *, dtype: Optional[torch.dtype] = None, device=None) -> HybridCache:
        """Decoding state for `batch_size` sequences of up to `max_len` tokens (KV + Mamba conv/SSM states)."""
        ref = self.lm_head.weight
        return HybridCache(
            self.language_model.layers, batch_size, max_len,
            dtype=dtype or ref.dtype, device=device if device is not None else ref.device,
        )

    def _init_module(self, module: nn.Module, std: float) -> None:
        if isinstance(module, RadioLayerScale):
            nn.init.ones_(module.lambda1)
        elif isinstance(module, RadioEmbeddings):
            nn.init.trunc_normal_(module.position_embedding, std=std)
            nn.init.trunc_normal_(module.cls_register_token, std=std)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init as transformers does (N(0, std) weights, zero biases, unit norms, Mamba S4D init)."""
        std = self.args.text.initializer_range
        super().init_weights(std)
        for module in self.modules():  # family-specific inits override the generic pass
            if isinstance(module, Mamba2Mixer):
                module.reset_parameters(std, num_layers=self.args.text.num_hidden_layers)
            elif isinstance(module, MoE):
                module.reset_parameters(std)
        self.tie_weights()

    # ----- forward -----
    def _image_features(self, pixel_values, image_grid_hw) -> tuple[torch.Tensor, list[int]]:
        if self.vision_model is None:
            raise ValueError("pixel_values given, but this nemotron_h model has no vision tower")
        if image_grid_hw is None:
            raise ValueError("pixel_values given without image_grid_hw (or image_grid_thw)")
        feats = self.vision_model(pixel_values.to(self.lm_head.weight.dtype), image_grid_hw)
        grids = [tuple(g) for g in on_host(image_grid_hw).tolist()]  # the host copy: no device sync
        out = shuffle_and_project(feats, grids, self.args.downsample_ratio, self.multi_modal_projector, self.vision_final_layernorm)
        return out, [gh * gw // self.args.merge_size**2 for gh, gw in grids]

    def _video_features(self, frames) -> tuple[torch.Tensor, list[int]]:
        if self.vision_model is None:
            raise ValueError("pixel_values_videos given, but this nemotron_h model has no vision tower")
        if self.args.video_pruning_rate > 0:
            raise NotImplementedError("video_pruning_rate > 0 (efficient video sampling) is not supported")
        feats, gh, gw = self.vision_model.forward_video(frames.to(self.lm_head.weight.dtype))
        groups = feats.shape[0] // (gh * gw)
        out = shuffle_and_project(feats, [(gh, gw)] * groups, self.args.downsample_ratio, self.multi_modal_projector,
                                  self.vision_final_layernorm)
        return out, [gh * gw // self.args.merge_size**2] * groups

    def embed(self, input_ids, *, pixel_values=None, image_grid_hw=None, pixel_values_videos=None, cu_seqlens=None):
        """Token embeddings with image / video features written at the placeholder tokens."""
        embeds = self.language_model.embeddings(input_ids)
        if pixel_values is not None and pixel_values_videos is not None:
            raise ValueError("give pixel_values or pixel_values_videos, not both (both use image_token_id placeholders)")
        for pixels, fn in ((pixel_values, lambda: self._image_features(pixel_values, image_grid_hw)),
                           (pixel_values_videos, lambda: self._video_features(pixel_values_videos))):
            if pixels is None:
                continue
            feats, per_item = fn()
            embeds = merge_vision_embeddings(
                embeds, input_ids, feats, self.args.image_token_id, modality="image",
                features_per_item=per_item, cu_seqlens=cu_seqlens,
            )
        return embeds

    # ----- forward (the template is VLMBase.forward) -----
    _takes = frozenset(set(VISION_INPUTS) | {"image_grid_hw"})
    _ignores = frozenset({"second_per_grid_ts", "mm_token_type_ids", "position_ids"})
    """No positional encoding in the decoder: positions and token types do not enter this model; a prompt
    shared by several packed segments (`prefix_segments`) is refused: a recurrent Mamba2 layer cannot start a
    continuation from its prompt's state."""

    def _embed(self, input_ids, cu_seqlens, inputs):
        """RADIO: images pixel_values `[total_patches, C*p*p]` + image_grid_hw `[n, 2]` (or image_grid_thw `[n, 3]`
        with t = 1); videos pixel_values_videos `[frames, C, H, W]`. Qwen3-VL tower: as Qwen3-VL, pixel_values
        `[patches, C*T*p*p]` + image_grid_thw `[n, 3]`, pixel_values_videos + video_grid_thw."""
        image_grid_thw, image_grid_hw = inputs.get("image_grid_thw"), inputs.get("image_grid_hw")
        if self.args.vision_tower != "qwen3_vl":
            return self._embed_radio(input_ids, inputs.get("pixel_values"), image_grid_thw, image_grid_hw,
                                     inputs.get("pixel_values_videos"), cu_seqlens), {}
        if image_grid_thw is None and image_grid_hw is not None:
            image_grid_thw = keep_host_copy(_with_frames(image_grid_hw), _with_frames(on_host(image_grid_hw)))
        return embed_vision_inputs(
            self.language_model.embeddings(input_ids), input_ids, {**inputs, "image_grid_thw": image_grid_thw},
            self.args, self.vision_model, merge_size=self.args.vision.spatial_merge_size, cu_seqlens=cu_seqlens,
            dtype=self.lm_head.weight.dtype, deepstack=True,
        )

    def _decode(self, embeds, input_ids, attention_mask, cu_seqlens, kv_cache, inputs, extra):
        """The hybrid decoder takes no positions; the cache's step is closed even when the run fails."""
        new_mask = attention_mask
        if kv_cache is not None:
            new_mask = new_tokens_mask(new_mask, input_ids)
            check = getattr(kv_cache, "check_padding", None)  # a SlotCache refuses any mask itself
            if new_mask is not None and check is not None:  # the host copy's new-token columns (no device read)
                check(new_tokens_mask(on_host(attention_mask), input_ids))
            kv_cache.begin_step(input_ids.shape[1], new_mask)
        try:
            return self.language_model(embeds, attention_mask=new_mask, cu_seqlens=cu_seqlens, cache=kv_cache, **extra)
        finally:
            if kv_cache is not None:
                kv_cache.end_step()

    def _embed_radio(self, input_ids, pixel_values, image_grid_thw, image_grid_hw, pixel_values_videos, cu_seqlens):
        if image_grid_hw is None and image_grid_thw is not None:
            host = on_host(image_grid_thw)
            if image_grid_thw.dim() != 2 or image_grid_thw.shape[-1] != 3 or bool((host[:, 0] != 1).any()):
                raise ValueError(f"image_grid_thw must be [n, 3] with t = 1 for nemotron images, got {host.tolist()}")
            image_grid_hw = keep_host_copy(image_grid_thw[:, 1:], host[:, 1:])
        return self.embed(
            input_ids, pixel_values=pixel_values, image_grid_hw=image_grid_hw,
            pixel_values_videos=pixel_values_videos, cu_seqlens=cu_seqlens,
        )

