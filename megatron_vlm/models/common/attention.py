"""Multi-head self-attention shared by the language decoders and the vision towers.

Covers what the supported families need: grouped-query attention (num_kv_heads divides
num_heads), optional bias on q/k/v and on the output projection, optional RMSNorm of q and
k (Qwen3-style QK-norm per head, applied before the rotary; or over the full q / k width with
`qk_norm_per_head=False`, as InternViT does), rotary angles given per token by the caller (1-D,
M-RoPE or 2-D vision; applied with `kernels.apply_rotary`; `cos=None` skips the rotary for
encoders with absolute position embeddings), and every attention call through `kernels.attention`:

* batched x `[B, S, hidden]` with an optional `key_padding_mask` `[B, S]` (True = real token);
* packed x `[T, hidden]` with `cu_seqlens` (no attention across samples / frames / windows);
* incremental decoding with a `KVCache` (keys of earlier steps are read from the cache; the kernel's
  bottom-right causal alignment places the new queries after them), or with the rollout engine's
  `SlotCache`, whose `attend` runs `kernels.decode_attention` on the slot layout.

q, k and v stay separate Linear layers; checkpoints with a fused qkv are split by the family's
state-dict adapter, never here. (The rollout engine may run them as one GEMM over a fused weight that
the three layers view: models/common/fused_projections.py; names and shapes unchanged.) Ready for tensor parallelism: the forward takes the number of heads
from the projections' outputs (`-1` in the reshapes), not from the constructor's global counts, so
a module whose q/k/v projections hold a column shard of the heads (and o_proj the matching row
shard) computes exactly those heads; `local_heads()` gives the counts such a module holds (e.g. to
size its KV cache). Per-head QK-norm works on a shard as is; the full-width QK-norm
(`qk_norm_per_head=False`) normalises over all heads and would need the whole q / k.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.models.common.fused_projections import FusedQKV, fused_enabled
from megatron_vlm.models.common.norms import RMSNorm


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    *,
    causal: bool,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    kv_cache=None,
    layer_idx: Optional[int] = None,
    prefix_layout=None,
    context_parallel=None,
    qk: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotary, then attention of per-head q / k / v (`[B, S, H, D]` or packed `[T, H, D]`) in every input
    form above; returns the per-head output (before the output projection). Shared with decoder layers
    whose projections are not this module's (megatron-core layers: models/mcore/layer.py). `qk`: q's heads then
    k's in one tensor (a view of a fused q / k / v output, the same values), which a slot-cache step rotates
    without concatenating them."""
    if cos is not None and kv_cache is not None and hasattr(kv_cache, "attend") and q.dtype == k.dtype:
        # a decode step of the slot cache: q and k rotated in one call (heads side by side, the rotary is per
        # element: the same numbers), halving the rotary's per-call cost, which dominates at one token per row
        qk = kernels.apply_rotary(qk if qk is not None else torch.cat([q, k], dim=-2), cos, sin)
        q, k = qk.split([q.shape[-2], k.shape[-2]], dim=-2)
    elif cos is not None:
        q = kernels.apply_rotary(q, cos, sin)
        k = kernels.apply_rotary(k, cos, sin)
    if kv_cache is not None:
        if cu_seqlens is not None:
            raise ValueError("Attention: a KV cache works with batched [B, S] input, not packed cu_seqlens")
        if hasattr(kv_cache, "attend"):  # a slot cache: one query token against each sequence's slot
            return kv_cache.attend(layer_idx, q, k, v)
        k, v, key_padding_mask = kv_cache.update(layer_idx, k, v)
    cu_k, max_k = cu_seqlens, max_seqlen
    if prefix_layout is not None:
        if cu_seqlens is None or kv_cache is not None or context_parallel is not None:
            raise ValueError("Attention: prefix_layout works with packed input (cu_seqlens), no KV cache and "
                             "no context parallelism")
        k, v = prefix_layout.gather(k, v)
        cu_k, max_k = prefix_layout.cu_seqlens_k, prefix_layout.max_seqlen_k
    if context_parallel is not None and cu_seqlens is not None and kv_cache is None:
        return context_parallel.attention(q, k, v, cu_seqlens, causal=causal)
    return kernels.attention(q, k, v, causal=causal, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_k,
                             max_seqlen_q=max_seqlen, max_seqlen_k=max_k, key_padding_mask=key_padding_mask)


class Attention(nn.Module):
    context_parallel = None
    """Set by `megatron_vlm.parallel.context_parallel.apply_cp`: packed input then holds this rank's
    tokens only and attends to the keys / values of the whole cp group."""
    _fused_qkv: Optional[FusedQKV] = None
    """Set by `fused_projections.fuse_qkv` (the rollout engine's own copy): q / k / v in one GEMM inside
    `fused_projections()`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        o_bias: bool = False,
        causal: bool = True,
        qk_norm_eps: Optional[float] = None,
        qk_norm_per_head: bool = True,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_kv_heads {num_kv_heads} must divide num_heads {num_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal = causal
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim if qk_norm_per_head else num_heads * head_dim, eps=qk_norm_eps)
            self.k_norm = RMSNorm(head_dim if qk_norm_per_head else num_kv_heads * head_dim, eps=qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _apply(self, fn, recurse=True):
        """`.to()` / `.half()` / ...: forgets a fused [q | k | v] tensor that the projections no longer view. Why: the
        conversion gives each projection data of its own, and the fused tensor, held here alone, would stay where it
        was (a judge that offloads its engine's model to the CPU between calls would keep it on the GPU); the next
        fusion (`fuse_qkv`, at the engine's next call) makes a new one."""
        out = super()._apply(fn, recurse)
        fused = self._fused_qkv
        if fused is not None and not fused.intact(self.q_proj, self.k_proj, self.v_proj):
            self._fused_qkv = None
        return out

    def local_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) that this module's projections hold: all of them, or a shard.

        From the weights' logical shapes: an FSDP-sharded DTensor still reports the whole projection
        (FSDP gathers it for the forward), a plain tensor holding a head shard reports the shard; a
        tensor-parallel DTensor reports the whole projection too, divided here by `tp_size` (set by
        `megatron_vlm.parallel.tensor_parallel.apply_tp`)."""
        tp = getattr(self, "tp_size", 1)
        return self.q_proj.weight.shape[0] // self.head_dim // tp, self.k_proj.weight.shape[0] // self.head_dim // tp

    def forward(
        self,
        x: torch.Tensor,
        cos: Optional[torch.Tensor],
        sin: Optional[torch.Tensor],
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        kv_cache=None,
        layer_idx: Optional[int] = None,
        prefix_layout=None,
    ) -> torch.Tensor:
        """x [B, S, hidden] or packed [T, hidden]; cos / sin per token [..., head_dim] (fp32), or None (no rotary).

        `prefix_layout` (a `prefix_sharing.PrefixLayout`, packed input only): segments continuing a shared
        prompt attend to its keys too."""
        lead = x.shape[:-1]
        fused, qk = self._fused_qkv, None
        if fused is not None and fused_enabled() and fused.intact(self.q_proj, self.k_proj, self.v_proj):
            qkv = F.linear(x, fused.weight, fused.bias)
            q, k, v = qkv.split(fused.sizes, dim=-1)
            if self.q_norm is None:  # q and k side by side: the slot cache's rotary takes them as they are
                qk = qkv.view(*lead, -1, self.head_dim)[..., : (fused.sizes[0] + fused.sizes[1]) // self.head_dim, :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        # -1: the heads these projections hold (all of them, or a tensor-parallel shard)
        q = q.view(*lead, -1, self.head_dim)
        k = k.view(*lead, -1, self.head_dim)
        v = v.view(*lead, -1, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(q, k, v, cos, sin, causal=self.causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                     key_padding_mask=key_padding_mask, kv_cache=kv_cache, layer_idx=layer_idx,
                     prefix_layout=prefix_layout, context_parallel=self.context_parallel, qk=qk)
        return self.o_proj(out.reshape(*lead, -1))
