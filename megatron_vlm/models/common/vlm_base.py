"""Structure shared by every `<Family>ForConditionalGeneration`: config bookkeeping, weight tying, the
FSDP / activation-checkpointing units, transformers-style random init, the decoding-cache constructor,
the checks on `forward`'s input forms (padded / packed / cached) and `forward` itself.

The families were written in parallel and repeated these pieces to the letter; they now inherit them.
`forward` is written once here as a template; each family says only what differs through small hooks:

* `_takes` / `_ignores`  the optional inputs it reads / accepts unused (any other one given is refused);
* `_embed(input_ids, cu_seqlens, inputs)`  token embeddings with the vision features written at their
  placeholders, and extra keyword arguments for the decoder (DeepStack features);
* `_positions(...)` / `_cached_positions(...)` / `_position_layout(p)`  the rotary positions of a
  padded or packed batch, of a cached decoding step, and their rank ([3, B, T] M-RoPE or [B, T]);
* `_decode(...)`  the decoder run (default: a rotary decoder taking positions; Nemotron-H has none);
* `_input_embeddings()`  the token embedding the lm_head is tied to (default `language_model.embed_tokens`);
* `_vision_blocks()`     the vision tower's blocks, listed before the decoder layers in `transformer_blocks()`;
* `_normal_init_types`   module types drawn from N(0, std) with zero bias by `init_weights`;
* `_init_module(m, std)` family-specific init of any other module (layer scales, position tables, MoE);
* `new_cache(batch_size, max_len, *, dtype, device)` (abstract): the family's decoding state, passed to
  `forward(..., kv_cache=)`; `KVCacheMixin` implements it for all-attention decoders (a `KVCache`),
  Nemotron-VL returns its hybrid KV + Mamba cache. Both follow the same step protocol
  (`begin_step` / `end_step`, `seq_len`, `valid_lengths()`, `repeat_interleave(g)`).

The trainer, the rollout engine and the checkpoint code call `lm_head`, `transformer_blocks()`,
`tie_weights()`, `init_weights()`, `new_cache()` and read `hf_config` / `hf_generation_config`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from megatron_vlm.host_copies import keep_host_copy, on_host
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.merge import VISION_INPUTS, embed_vision_inputs
from megatron_vlm.models.common.mrope_index import (
    appended_mrope_position_ids,
    cached_mrope_position_ids,
    get_mrope_position_ids,
)
from megatron_vlm.models.common.norms import LayerNorm, RMSNorm
from megatron_vlm.models.common.prefix_sharing import prefix_layout_and_positions
from megatron_vlm.models.common.text_positions import text_position_ids

# the optional inputs of `forward` a family may take (data.batch.MODEL_INPUT_KEYS, Nemotron's image_grid_hw)
OPTIONAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                   "mm_token_type_ids", "image_grid_hw", "position_ids", "prefix_segments")


def cu_seqlens_max(cu_seqlens: torch.Tensor) -> int:
    """The longest segment of a packed sequence (0 for an empty `cu_seqlens`), read from its host copy when it
    has one (megatron_vlm/host_copies.py: the loader's, or the vision tower's own; no device sync)."""
    cu = on_host(cu_seqlens)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def check_forward_inputs(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    kv_cache,
) -> Optional[torch.Tensor]:
    """Validate the three input forms of a VLM forward; returns `cu_seqlens` as int32 (or None).

    padded: input_ids [B, T] (+ attention_mask [B, T]); packed: input_ids [1, T] + cu_seqlens, no mask,
    no cache; cached decoding: the mask may also cover the cached tokens (then it is not [B, T])."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1:
            raise ValueError(f"packed input (cu_seqlens) needs input_ids [1, T], got {tuple(input_ids.shape)}")
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed) or attention_mask (padded), not both")
        if kv_cache is not None:
            raise ValueError("kv_cache is not supported with packed input (cu_seqlens)")
        cu_seqlens = keep_host_copy(cu_seqlens.to(torch.int32), on_host(cu_seqlens))
    if attention_mask is not None and kv_cache is None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    return cu_seqlens


def new_tokens_mask(mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """In cached decoding the mask may cover past + new tokens: keep the part over the new tokens."""
    if mask is not None and mask.shape[1] != input_ids.shape[1]:
        mask = mask[:, -input_ids.shape[1]:]
    return mask


class VLMBase(nn.Module):
    """Base of the family models: holds `args` (validated), `hf_config`, `hf_generation_config`.

    Subclasses build `language_model` and `lm_head` in their `__init__` and then call `tie_weights()`."""

    _normal_init_types: tuple[type, ...] = (nn.Linear, nn.Embedding)
    _takes: frozenset[str] = frozenset({"position_ids", "prefix_segments"})
    """The optional inputs (`OPTIONAL_INPUTS`) this family reads."""
    _ignores: frozenset[str] = frozenset()
    """Optional inputs accepted for the shared call signature and not used; any other one given is refused."""

    def __init__(self, args, hf_config: Optional[dict] = None) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.hf_config = hf_config  # the config.json dict written back on export
        self.hf_generation_config: Optional[dict] = None

    # ----- hooks -----
    def _input_embeddings(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def _vision_blocks(self) -> list[nn.Module]:
        return []

    def _init_module(self, module: nn.Module, std: float) -> None:
        """Family-specific init of a module that is not Linear / Embedding / a norm (default: leave it)."""

    def _refuse(self, names: list[str]) -> None:
        """Raise for optional inputs this family does not take (`_takes`, `_ignores`)."""
        raise ValueError(f"{type(self).__name__} does not take {names}")

    def _embed(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
               inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """(token embeddings [B, T, H] with the vision features at their placeholders, extra decoder kwargs)."""
        return self._input_embeddings()(input_ids), {}

    def _positions(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   cu_seqlens: Optional[torch.Tensor], inputs: dict[str, Any]) -> torch.Tensor:
        """Rotary positions of a padded or packed batch (no cache)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _positions()")

    def _cached_positions(self, input_ids: torch.Tensor, new_mask: Optional[torch.Tensor], kv_cache,
                          inputs: dict[str, Any]) -> torch.Tensor:
        """Rotary positions of the new tokens of a cached forward (before the cache's `begin_step`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _cached_positions()")

    def _position_layout(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rank the decoder takes (M-RoPE: [3, B, T]; 1-D RoPE: [B, T]); default: as given."""
        return position_ids

    def _decode(
        self,
        embeds: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        cu_seqlens: Optional[torch.Tensor],
        kv_cache,
        inputs: dict[str, Any],
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """Final-norm hidden states of a rotary decoder (`language_model(embeds, position_ids, ...)`): positions
        derived unless given, the cache's step opened and closed around the run."""
        position_ids = inputs.get("position_ids")
        key_padding_mask = attention_mask.bool() if attention_mask is not None else None
        if kv_cache is not None:
            new_mask = new_tokens_mask(key_padding_mask, input_ids)
            if position_ids is None:
                position_ids = self._cached_positions(input_ids, new_mask, kv_cache, inputs)
            kv_cache.begin_step(input_ids.shape[1], new_mask)
            key_padding_mask = None  # the cache supplies the mask over all cached keys
        elif position_ids is None:
            position_ids = self._positions(input_ids, attention_mask, cu_seqlens, inputs)
        position_ids, prefix_layout = prefix_layout_and_positions(
            self._position_layout(position_ids), cu_seqlens, inputs.get("prefix_segments"))
        hidden = self.language_model(
            embeds, position_ids, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, kv_cache=kv_cache,
            prefix_layout=prefix_layout, **extra,
        )
        if kv_cache is not None:
            kv_cache.end_step()
        return hidden

    def takes_input(self, name: str) -> bool:
        """Whether `forward` reads the optional input `name` (`_takes`)."""
        return name in self._takes

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
        image_grid_hw: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        kv_cache=None,
        return_hidden: bool = False,
        prefix_segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or final-norm hidden states [B, T, H] with `return_hidden=True`).

        Input forms: padded (input_ids [B, T] + attention_mask), packed (input_ids [1, T] + `cu_seqlens`),
        cached decoding (`kv_cache` from `new_cache`; the mask may also cover the cached tokens). The vision
        inputs, `position_ids` and `prefix_segments` (packed: a prompt shared by several segments,
        models/common/prefix_sharing.py) are read as the family's hooks say (module docstring); an input the
        family does not take is refused (ValueError), one it ignores is dropped."""
        given = dict(
            pixel_values=pixel_values, image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts, mm_token_type_ids=mm_token_type_ids,
            image_grid_hw=image_grid_hw, position_ids=position_ids, prefix_segments=prefix_segments,
        )
        refused = [k for k, v in given.items() if v is not None and k not in self._takes and k not in self._ignores]
        if refused:
            self._refuse(refused)
        inputs = {k: v for k, v in given.items() if k in self._takes}
        cu_seqlens = check_forward_inputs(input_ids, attention_mask, cu_seqlens, kv_cache)
        embeds, extra = self._embed(input_ids, cu_seqlens, inputs)
        hidden = self._decode(embeds, input_ids, attention_mask, cu_seqlens, kv_cache, inputs, extra)
        return hidden if return_hidden else self.lm_head(hidden)

    # ----- structure helpers used by parallelize / loading / training -----
    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self._input_embeddings().weight

    def transformer_blocks(self) -> list[nn.Module]:
        """The FSDP / activation-checkpointing units: vision blocks then decoder layers."""
        return list(self._vision_blocks()) + list(self.language_model.layers)

    def new_cache(
        self, batch_size: int, max_len: int, *, dtype: Optional[torch.dtype] = None, device=None
    ):
        """An empty decoding cache for `batch_size` sequences of up to `max_len` tokens (prompt + generated),
        in `dtype` on `device` (default: the lm_head weight's). Every family implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement new_cache()")

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init as transformers does: N(0, std) for `_normal_init_types` weights, zero biases, unit
        norms, then `_init_module` for everything else; the tie is restored at the end."""
        for module in self.modules():
            if isinstance(module, self._normal_init_types):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, LayerNorm)):
                module.reset_parameters()
            else:
                self._init_module(module, std)
        self.tie_weights()


class KVCacheMixin:
    """`new_cache` for models whose decoder is all attention layers (`language_model.layers[i].self_attn`).

    The KV shape comes from the attention modules themselves (`Attention.local_heads()`), so a decoder
    whose attention holds a tensor-parallel shard of the heads gets a cache of that shard."""

    def new_cache(self, batch_size: int, max_len: int, *, dtype: Optional[torch.dtype] = None, device=None) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_len` tokens (prompt + generated)."""
        layers = self.language_model.layers
        # a megatron-core layer answers for its attention itself (its `self_attn`, if any, holds LoRA adapters)
        attn = layers[0] if hasattr(layers[0], "local_heads") else layers[0].self_attn
        ref = self.lm_head.weight
        return KVCache(
            len(layers), batch_size, max_len, attn.local_heads()[1], attn.head_dim,
            dtype=dtype or ref.dtype, device=device if device is not None else ref.device,
        )


class MRopePositionsMixin:
    """The position hooks of the M-RoPE families (Qwen2.5-VL, Qwen3-VL): positions [3, B, T] with the original
    Qwen2.5-VL get_rope_index semantics (`mrope_index.get_mrope_position_ids`, from the grids, frame intervals and token
    types given); cached decoding continues them at the rope deltas the prefill stored in the cache (a later chunk
    with images / videos: its own index shifted there, `mrope_index.appended_mrope_position_ids`); given
    [B, T] positions are broadcast to the three rows. A family may override how video time is counted
    (`_tokens_per_second`, `_video_grids`)."""

    def _tokens_per_second(self) -> float:
        return self.args.vision.tokens_per_second

    def _video_grids(self, video_grid_thw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return video_grid_thw

    def _rope_index(self, input_ids, attention_mask, cu_seqlens, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(position_ids [3, B, T], rope_deltas [B or samples, 1])."""
        return get_mrope_position_ids(
            input_ids, image_token_id=self.args.image_token_id, video_token_id=self.args.video_token_id,
            spatial_merge_size=self.args.vision.spatial_merge_size, tokens_per_second=self._tokens_per_second(),
            image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=self._video_grids(inputs.get("video_grid_thw")),
            second_per_grid_ts=inputs.get("second_per_grid_ts"), attention_mask=attention_mask,
            mm_token_type_ids=inputs.get("mm_token_type_ids"), cu_seqlens=cu_seqlens,
        )

    def _positions(self, input_ids, attention_mask, cu_seqlens, inputs):
        return self._rope_index(input_ids, attention_mask, cu_seqlens, inputs)[0]

    def _cached_positions(self, input_ids, new_mask, kv_cache, inputs):
        index = lambda mask: self._rope_index(input_ids, mask, None, inputs)  # noqa: E731
        if kv_cache.seq_len > 0 and any(inputs.get(k) is not None for k in VISION_INPUTS):
            return appended_mrope_position_ids(kv_cache, new_mask, index)  # a later chunk with images / videos
        return cached_mrope_position_ids(input_ids, kv_cache, new_mask, index)

    def _position_layout(self, position_ids):
        return position_ids.unsqueeze(0).expand(3, -1, -1) if position_ids.dim() == 2 else position_ids


class TextPositionsMixin:
    """The position hooks of the 1-D RoPE families (InternVL's LLM, text-only Qwen): positions [B, T] counting
    real tokens (`text_positions.py`), restarting per packed sample, continuing after the cached tokens; given
    [3, B, T] positions give their first row."""

    def _positions(self, input_ids, attention_mask, cu_seqlens, inputs):
        return text_position_ids(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens)

    def _cached_positions(self, input_ids, new_mask, kv_cache, inputs):
        return text_position_ids(input_ids, attention_mask=new_mask, kv_cache=kv_cache)

    def _position_layout(self, position_ids):
        return position_ids[0] if position_ids.dim() == 3 else position_ids


class QwenVLBase(MRopePositionsMixin, KVCacheMixin, VLMBase):
    """Qwen2.5-VL and Qwen3-VL: `visual` (the family's `_vision_cls`), `language_model` (`_text_cls`) and `lm_head`
    (shares the embedding Parameter when tied); images and videos through the tower at their placeholders
    (`merge.embed_vision_inputs`; `_deepstack`: the tower also returns DeepStack levels), M-RoPE positions."""

    _vision_cls: type
    _text_cls: type
    _deepstack = False
    _takes = frozenset(VLMBase._takes | set(VISION_INPUTS) | {"second_per_grid_ts", "mm_token_type_ids"})

    def __init__(self, args: Any, hf_config: Optional[dict] = None) -> None:
        super().__init__(args, hf_config)
        self.visual = self._vision_cls(args.vision)
        self.language_model = self._text_cls(args.text)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    def _vision_blocks(self) -> list[nn.Module]:
        return list(self.visual.blocks)

    def _embed(self, input_ids, cu_seqlens, inputs):
        return embed_vision_inputs(
            self.language_model.embed_tokens(input_ids), input_ids, inputs, self.args, self.visual,
            merge_size=self.args.vision.spatial_merge_size, cu_seqlens=cu_seqlens, deepstack=self._deepstack,
        )
