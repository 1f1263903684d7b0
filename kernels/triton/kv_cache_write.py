"""Triton KV-cache write: a decode step's new keys and values into their cache positions in one launch.

Contract: `kernels/reference/kv_cache_write.py` (two `index_put`s, plus the copies of their strided inputs:
four launches per attention layer and token, where this is one). The inputs are read through their strides
(the k / v heads of a fused q / k / v output need no copy); a row whose indices fall outside the cache is not
written (the indices stay on the device: checking them on the host would be a sync per layer).
"""
import torch
import triton
import triton.language as tl

from ..reference.kv_cache_write import check_kv_cache_write_inputs
from .common import check_device, to_dtype


@triton.jit
def _kv_write_kernel(K, V, KC, VC, I0, I1, n_heads, n0, n1, sk_r, sk_h, sv_r, sv_h, skc0, skc1, skc_h, svc0, svc1, svc_h,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i0 = tl.load(I0 + row).to(tl.int64)
    i1 = tl.load(I1 + row).to(tl.int64)
    inside = (i0 >= 0) & (i0 < n0) & (i1 >= 0) & (i1 < n1)
    heads_here = tl.where(inside, n_heads, 0)  # a row outside the cache writes no head
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (heads[:, None] < heads_here) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + row * sk_r + heads[:, None] * sk_h + d[None, :], mask=m, other=0.0)
    tl.store(KC + i0 * skc0 + i1 * skc1 + heads[:, None] * skc_h + d[None, :], to_dtype(k, KC.dtype.element_ty), mask=m)
    v = tl.load(V + row * sv_r + heads[:, None] * sv_h + d[None, :], mask=m, other=0.0)
    tl.store(VC + i0 * svc0 + i1 * svc1 + heads[:, None] * svc_h + d[None, :], to_dtype(v, VC.dtype.element_ty), mask=m)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   index0: torch.Tensor, index1: torch.Tensor) -> None:
    """Public-signature KV-cache write on the Triton kernel."""
    check_kv_cache_write_inputs(k, v, k_cache, v_cache, index0, index1)
    check_device("kv_cache_write", k, v, k_cache, v_cache, index0, index1)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:  # a cache laid out otherwise: the reference writes it
        from ..reference.kv_cache_write import kv_cache_write as reference

        return reference(k, v, k_cache, v_cache, index0, index1)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    rows, heads, d = k.shape
    if rows == 0 or heads == 0:
        return None
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
    _kv_write_kernel[(rows, triton.cdiv(heads, block_h))](
        k, v, k_cache, v_cache, index0, index1, heads, k_cache.shape[0], k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return None
