"""Structure shared by every `<Family>ForConditionalGeneration`: config bookkeeping, weight tying, the
FSDP / activation-checkpointing units, transformers-style random init, the decoding-cache constructor,
and the checks on `forward`'s input forms (padded / packed / cached).

The families were written in parallel and repeated these pieces to the letter; they now inherit them.
Each family says only what differs through small hooks:

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

from typing import Optional

import torch
from torch import nn

from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.norms import LayerNorm, RMSNorm


def cu_seqlens_max(cu_seqlens: torch.Tensor) -> int:
    """The longest segment of a packed sequence (0 for an empty `cu_seqlens`)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


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
        cu_seqlens = cu_seqlens.to(torch.int32)
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
