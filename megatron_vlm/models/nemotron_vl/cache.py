"""Decoding state of the hybrid Nemotron-H decoder: a KV cache for the attention layers and a
conv + SSM state per Mamba2 layer.

Same step protocol as `KVCache` (the rollout engine drives both the same way): the model calls
`begin_step(n_new, new_mask)`, each layer reads / writes its state, then `end_step()`. The KV part
is a `KVCache` over the attention layers only (`kv_index(layer)` maps a decoder layer to its slot);
its padding mask also serves left-padded prompts for attention, while the Mamba mixers zero the
padding themselves. Only padding before a sequence's first token keeps the recurrent state exact, so a
cached forward that pads after a real token is refused (`check_padding`). `repeat_interleave(g)` turns a cache prefilled for B prompts into one for
B * g sequences (a GRPO group shares one prefill).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.host_copies import on_host
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.mamba2 import Mamba2State


class HybridCache:
    def __init__(
        self,
        layers: nn.ModuleList,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self._kv_index: dict[int, int] = {}
        self._mamba: dict[int, Mamba2State] = {}
        attention = None
        for i, layer in enumerate(layers):
            if layer.block_type == "full_attention":
                self._kv_index[i] = len(self._kv_index)
                attention = layer.mixer
            elif layer.block_type == "linear_attention":
                self._mamba[i] = Mamba2State.zeros(layer.mixer, batch, device=device)
        if attention is not None:
            self.kv: Optional[KVCache] = KVCache(
                len(self._kv_index), batch, max_len, attention.local_heads()[1], attention.head_dim, dtype=dtype, device=device
            )
        else:  # a decoder without attention still tracks lengths and padding
            self.kv = KVCache(1, batch, max_len, 1, 1, dtype=dtype, device=device)

    # ----- per-layer access -----
    def kv_index(self, layer_idx: int) -> int:
        if layer_idx not in self._kv_index:
            raise KeyError(f"HybridCache: layer {layer_idx} is not an attention layer")
        return self._kv_index[layer_idx]

    def mamba_state(self, layer_idx: int) -> Mamba2State:
        if layer_idx not in self._mamba:
            raise KeyError(f"HybridCache: layer {layer_idx} is not a Mamba2 layer")
        return self._mamba[layer_idx]

    # ----- step protocol (delegated to the KV cache, which owns lengths and the padding mask) -----
    @property
    def batch(self) -> int:
        return self.kv.batch

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def seq_len(self) -> int:
        return self.kv.seq_len

    @property
    def mask(self) -> torch.Tensor:
        return self.kv.mask

    def valid_lengths(self) -> torch.Tensor:
        return self.kv.valid_lengths()

    def check_padding(self, new_mask: torch.Tensor) -> None:
        """ValueError when `new_mask` `[B, n_new]` (its host copy where it has one) pads a sequence after a real
        token, cached or new. Why: a padded token's input is zeroed, but it still shifts the Mamba2 conv window and
        decays the SSM state, so that sequence would continue from a wrong state, silently. Left padding before a
        sequence's first token is exact (the state is still zero). Reads the cached lengths from the device only
        when the cache holds tokens (never on the rollout engine's path: it passes a mask only to prefills)."""
        mask = on_host(new_mask).bool().cpu()
        started = torch.zeros(mask.shape[0], 1, dtype=torch.bool)
        if self.seq_len > 0:
            started = (self.valid_lengths() > 0).cpu()[:, None]
        before = mask.long().cumsum(-1) - mask.long() > 0  # a real new token earlier in the row
        bad = ~mask & (started | before)
        if bool(bad.any()):
            rows = sorted({int(r) for r in bad.nonzero()[:, 0]})
            raise ValueError(
                f"attention_mask: padding after a real token in a cached forward of the hybrid (Mamba2) decoder "
                f"(rows {rows}): its recurrent state would take the padding in; pad prompts on the left only and "
                "feed the cached sequences' new tokens unpadded")

    def begin_step(self, n_new: int, new_mask: Optional[torch.Tensor] = None) -> None:
        self.kv.begin_step(n_new, new_mask)

    def end_step(self) -> None:
        self.kv.end_step()

    def repeat_interleave(self, g: int) -> HybridCache:
        """A new cache with every sequence repeated g times consecutively (B -> B * g), states copied."""
        out = HybridCache.__new__(HybridCache)
        out._kv_index = dict(self._kv_index)
        out._mamba = {i: s.repeat_interleave(g) for i, s in self._mamba.items()}
        out.kv = self.kv.repeat_interleave(g)
        return out

    expand = repeat_interleave
