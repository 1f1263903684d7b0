"""KV-cache write of a decode step: each row's new key and value into its cache position.

`kv_cache_write(k, v, k_cache, v_cache, index0, index1)`: k / v `[N, Hkv, D]` (any strides), the caches
`[A, B, Hkv, D]`; row i goes to `k_cache[index0[i], index1[i]]` and `v_cache[index0[i], index1[i]]`, cast to
the cache's dtype. The slot cache passes (slot, position), the paged cache (block, offset in the block). The
indices are device tensors (a CUDA-graph decode step reads no value on the host); rows that name the same
position (padding rows on a scratch slot) leave one of them there. This reference is two `index_put`s; the
Triton backend writes keys and values in one launch (a decode step writes every attention layer's cache, so
it runs this once per layer per token).
"""
import torch

__all__ = ["kv_cache_write", "check_kv_cache_write_inputs"]


def check_kv_cache_write_inputs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                index0: torch.Tensor, index1: torch.Tensor) -> None:
    """Shapes and dtypes (no index value is read: that would be a device sync)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"kv_cache_write: k / v must be [N, Hkv, D] of one shape, got {tuple(k.shape)} / {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache_write: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[A, B, {k.shape[1]}, {k.shape[2]}]")
    for name, ix in (("index0", index0), ("index1", index1)):
        if ix.shape != (k.shape[0],) or ix.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kv_cache_write: {name} must be an int32 / int64 [{k.shape[0]}] tensor, got "
                             f"{ix.dtype} {tuple(ix.shape)}")


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   index0: torch.Tensor, index1: torch.Tensor) -> None:
    check_kv_cache_write_inputs(k, v, k_cache, v_cache, index0, index1)
    k_cache[index0, index1] = k.to(k_cache.dtype)
    v_cache[index0, index1] = v.to(v_cache.dtype)
