"""Pre-allocated key/value cache for incremental decoding of a left-padded batch (the rollout engine's
prefill, whose rows it then copies into its `SlotCache`; cached generation in tests and tools).

Layout per layer: k, v `[B, max_len, num_kv_heads, head_dim]` (the batched layout of
`kernels.attention`), plus one `[B, max_len]` bool mask of real tokens shared by all layers, so
left-padded prompts work: padding slots stay masked for every later query.

A model forward with `kv_cache=` calls `begin_step(n_new, new_mask)`, then each attention layer
`update(layer_idx, k, v)` (which writes the new keys / values and returns the visible prefix), then
`end_step()`. M-RoPE models store the prefill's per-sample `rope_deltas` here so decoding continues
the 3-D positions (`position = real tokens so far + rope_delta`).

`expand(g)` / `repeat_interleave(g)` turn a cache prefilled for B prompts into one for B * g
sequences (each prompt repeated g times, consecutively), so a GRPO group shares one prefill;
`select_rows(rows)` keeps only some sequences (finished ones dropped).
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, batch, max_len, num_kv_heads, head_dim) < 1:
            raise ValueError(
                f"KVCache: sizes must be positive, got num_layers={num_layers} batch={batch} max_len={max_len} "
                f"num_kv_heads={num_kv_heads} head_dim={head_dim}"
            )
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.rope_deltas = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.seq_len = 0
        self._pending: Optional[int] = None

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def valid_lengths(self) -> torch.Tensor:
        """Real (non-padding) tokens cached per sequence: [B] long."""
        return self.mask[:, : self.seq_len].sum(dim=1)

    def set_rope_deltas(self, deltas: torch.Tensor) -> None:
        if deltas.shape != (self.batch, 1):
            raise ValueError(f"KVCache: rope_deltas must be [{self.batch}, 1], got {tuple(deltas.shape)}")
        self.rope_deltas = deltas.to(self.mask.device, torch.long)

    def begin_step(self, n_new: int, new_mask: Optional[torch.Tensor] = None) -> None:
        if self._pending is not None:
            raise RuntimeError("KVCache: begin_step called twice without end_step")
        if self.seq_len + n_new > self.max_len:
            raise ValueError(f"KVCache: {self.seq_len} cached + {n_new} new tokens exceed max_len {self.max_len}")
        if new_mask is not None and tuple(new_mask.shape) != (self.batch, n_new):
            raise ValueError(f"KVCache: mask of the new tokens must be [{self.batch}, {n_new}], got {tuple(new_mask.shape)}")
        self.mask[:, self.seq_len : self.seq_len + n_new] = True if new_mask is None else new_mask.bool()
        self._pending = n_new

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """Write k / v [B, n_new, Hkv, D] of one layer; return (keys, values, key_padding_mask) up to the new end."""
        if self._pending is None:
            raise RuntimeError("KVCache: update called outside begin_step / end_step")
        if k.shape[:2] != (self.batch, self._pending):
            raise ValueError(f"KVCache: layer {layer_idx} k has shape {tuple(k.shape)}, expected [{self.batch}, {self._pending}, ...]")
        end = self.seq_len + self._pending
        self.keys[layer_idx][:, self.seq_len : end] = k
        self.values[layer_idx][:, self.seq_len : end] = v
        return self.keys[layer_idx][:, :end], self.values[layer_idx][:, :end], self.mask[:, :end]

    def end_step(self) -> None:
        if self._pending is None:
            raise RuntimeError("KVCache: end_step without begin_step")
        self.seq_len += self._pending
        self._pending = None

    def _map_rows(self, fn) -> KVCache:
        """A new cache whose every per-sequence tensor is fn(tensor) along dim 0; the cached length is kept."""
        if self._pending is not None:
            raise RuntimeError("KVCache: cannot change rows in the middle of a step")
        out = KVCache.__new__(KVCache)
        out.keys = [fn(k) for k in self.keys]
        out.values = [fn(v) for v in self.values]
        out.mask = fn(self.mask)
        out.rope_deltas = fn(self.rope_deltas)
        out.seq_len = self.seq_len
        out._pending = None
        return out

    def repeat_interleave(self, g: int) -> KVCache:
        """A new cache with every sequence repeated g times consecutively (B -> B * g); the cached prefix is copied."""
        if g < 1:
            raise ValueError(f"KVCache.repeat_interleave: g must be >= 1, got {g}")
        return self._map_rows(lambda t: t.repeat_interleave(g, dim=0))

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding only the sequences `rows` (1-D index), e.g. to drop finished ones."""
        rows = rows.to(self.mask.device)
        return self._map_rows(lambda t: t.index_select(0, rows))

    expand = repeat_interleave
