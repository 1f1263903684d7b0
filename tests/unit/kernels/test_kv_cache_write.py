"""`kernels.kv_cache_write`: the Triton kernel (one launch for a decode step's keys and values; interpreted on the
CPU) writes exactly what the torch reference's two `index_put`s write (slot layout (slot, position) and paged
layout (block, offset), inputs that are strided views of a fused q / k / v output, a cast to the cache's dtype),
touches nothing else, and skips a row whose indices fall outside the cache where the reference raises."""
import pytest
import torch
from kernel_checks import DEVICE

from megatron_vlm.kernels.reference.kv_cache_write import kv_cache_write as reference
from megatron_vlm.kernels.triton.kv_cache_write import kv_cache_write as triton_write


def _case(g, *, dtype_in=torch.float32, dtype_cache=torch.float32, n=5, heads=2, d=16, shape=(4, 12)):
    qkv = torch.randn(n, 4 + 2 * heads, d, generator=g).to(dtype_in)  # [N, q 4 | k | v heads, D]
    k, v = qkv[:, 4:4 + heads], qkv[:, 4 + heads:]
    kc = torch.randn(*shape, heads, d, generator=g).to(dtype_cache)
    vc = torch.randn(*shape, heads, d, generator=g).to(dtype_cache)
    flat = torch.randperm(shape[0] * shape[1], generator=g)[:n]  # distinct positions
    i0, i1 = flat // shape[1], flat % shape[1]
    return [t.to(DEVICE) for t in (k, v, kc, vc, i0, i1)]


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(4, 12), (9, 4)])  # slots x positions; blocks x offsets
def test_triton_writes_what_the_reference_writes(dtypes, shape):
    k, v, kc, vc, i0, i1 = _case(torch.Generator().manual_seed(0), dtype_in=dtypes[0], dtype_cache=dtypes[1], shape=shape)
    assert not k.is_contiguous()  # read through its strides
    want_k, want_v = kc.clone(), vc.clone()
    reference(k, v, want_k, want_v, i0, i1)
    got_k, got_v = kc.clone(), vc.clone()
    triton_write(k, v, got_k, got_v, i0, i1)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(want_k, kc)  # something was written


def test_out_of_range_rows_are_skipped_not_written_elsewhere():
    k, v, kc, vc, i0, i1 = _case(torch.Generator().manual_seed(1), n=3, shape=(4, 12))
    i1 = torch.tensor([2, 12, 5], device=i1.device)  # row 1 points past the cache's positions
    got_k, got_v = kc.clone(), vc.clone()
    triton_write(k, v, got_k, got_v, i0, i1)
    keep = torch.tensor([True, False, True])
    want_k, want_v = kc.clone(), vc.clone()
    reference(k[keep], v[keep], want_k, want_v, i0[keep], i1[keep])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    if DEVICE == "cpu":  # on CUDA the reference's index_put fails with a device-side assert instead
        with pytest.raises(IndexError):
            reference(k, v, kc.clone(), vc.clone(), i0, i1)


def test_bad_shapes_are_refused():
    k, v, kc, vc, i0, i1 = _case(torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="index1"):
        triton_write(k, v, kc, vc, i0, i1[:2])
    with pytest.raises(ValueError, match="caches"):
        triton_write(k, v, kc[..., :8], vc[..., :8], i0, i1)
