"""The `sdpa` attention backend (torch scaled_dot_product_attention) against the torch reference.

Packed inputs take one of three paths (padded batch, one block-diagonal mask, query tiles); each is
tested. fp32: output and gradients within 1e-5 of the reference (which computes fp32 softmax over
materialised scores; SDPA's fused kernels reorder the reduction, hence not bit-exact). bf16: the
2x-of-the-naive-low-precision-reference rule of the other attention kernels. Cases: packed varlen
(several samples, awkward lengths, empty samples, Sq != Sk, rows without keys), batched with and
without key padding, GQA / MQA, causal and bidirectional (vision) with windows, and the tiled path
for packs whose mask would be too large (forced by lowering the threshold).
"""
import pytest
import torch
from kernel_checks import assert_within_2x, cu_seqlens, max_err

import megatron_vlm.kernels as K
from megatron_vlm.kernels.reference.attention import attention as reference
from megatron_vlm.kernels.sdpa import attention as sdpa_mod

TOL = 1e-5


def _inputs(q_shape, kv_shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*q_shape, generator=g).to(dtype)
    k = torch.randn(*kv_shape, generator=g).to(dtype)
    v = torch.randn(*kv_shape, generator=g).to(dtype)
    return q, k, v


def _compare_fp32(q, k, v, **kw):
    """Output and dq / dk / dv of sdpa vs the reference, both fp32."""
    a = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_mod.attention(*a, **kw)
    ref = reference(*b, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert max_err(out, ref) <= TOL, f"out: {max_err(out, ref):.3g}"
    dout = torch.randn_like(ref)
    for name, g1, g2 in zip("qkv", torch.autograd.grad(out, a, dout), torch.autograd.grad(ref, b, dout)):
        assert torch.isfinite(g1).all(), f"d{name}: non-finite"
        assert max_err(g1, g2) <= TOL, f"d{name}: {max_err(g1, g2):.3g}"
    return out


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, -1)), (False, (6, 3))])
def test_packed_gqa_causal_and_bidirectional(causal, window):
    lens = [1, 7, 0, 33, 19]  # includes an empty sample
    q, k, v = _inputs((sum(lens), 4, 16), (sum(lens), 2, 16), seed=1)
    cu = cu_seqlens(lens)
    _compare_fp32(q, k, v, causal=causal, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("path", ["padded", "block_mask"])
def test_packed_many_short_samples_both_paths(path, monkeypatch):
    # many short samples: the padded-batch path wins; with a huge-sample pack the block mask does
    lq, lk = ([5, 9, 3, 0, 8, 7, 1, 6, 9], [5, 12, 3, 0, 8, 4, 1, 6, 9]) if path == "padded" else ([3, 60, 2, 1], [3, 60, 4, 1])
    calls = []
    real = sdpa_mod._padded
    monkeypatch.setattr(sdpa_mod, "_padded", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs((sum(lq), 4, 8), (sum(lk), 2, 8), seed=8)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    for causal, window in ((True, None), (False, None), (True, (2, -1)), (False, (3, 1))):
        _compare_fp32(q, k, v, causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert bool(calls) == (path == "padded")


def test_packed_cross_lengths_rows_without_keys_mqa():
    # Sq < Sk (decode alignment, bottom-right) and Sq > Sk (first rows see no key -> zeros)
    lq, lk = [1, 5, 9], [17, 40, 3]
    q, k, v = _inputs((sum(lq), 4, 8), (sum(lk), 1, 8), seed=2)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    out = _compare_fp32(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert out[6:12].abs().max() == 0


def test_single_sample_fast_path_and_tiled_long_pack(monkeypatch):
    lens = [40]
    q, k, v = _inputs((40, 2, 8), (40, 2, 8), seed=3)
    _compare_fp32(q, k, v, causal=True, cu_seqlens_q=cu_seqlens(lens), cu_seqlens_k=cu_seqlens(lens))
    # tiles of 3 query rows (some spanning two samples, some inside one) against their samples' keys
    monkeypatch.setattr(sdpa_mod, "MAX_MASK_ELEMENTS", 3 * 60)
    lens = [13, 0, 2, 30, 15]
    q, k, v = _inputs((60, 4, 8), (60, 2, 8), seed=4)
    cu = cu_seqlens(lens)
    for causal in (True, False):
        _compare_fp32(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=None if causal else (4, 2))


@pytest.mark.parametrize("causal", [True, False])
def test_batched_with_and_without_key_padding(causal):
    q, k, v = _inputs((3, 11, 4, 8), (3, 11, 2, 8), seed=5)
    _compare_fp32(q, k, v, causal=causal)
    keep = torch.ones(3, 11, dtype=torch.bool)
    keep[0, :4] = False  # left padding
    keep[1, 7:] = False  # right padding
    keep[2, :] = False  # a fully padded row: zeros, finite gradients
    out = _compare_fp32(q, k, v, causal=causal, key_padding_mask=keep, softmax_scale=0.3)
    assert out[2].abs().max() == 0
    # Sq != Sk (bottom-right causal) and a window
    q2 = q[:, :4]
    _compare_fp32(q2, k, v, causal=causal, window=(3, 2))


@pytest.mark.parametrize("packed", [True, False])
def test_bf16_within_2x_of_naive_reference(packed):
    lens = [7, 50, 21]
    if packed:
        q, k, v = _inputs((78, 4, 32), (78, 2, 32), dtype=torch.bfloat16, seed=6)
        kw = dict(causal=True, cu_seqlens_q=cu_seqlens(lens), cu_seqlens_k=cu_seqlens(lens))
    else:
        q, k, v = _inputs((2, 40, 4, 32), (2, 40, 2, 32), dtype=torch.bfloat16, seed=6)
        keep = torch.ones(2, 40, dtype=torch.bool)
        keep[1, :9] = False
        kw = dict(causal=True, key_padding_mask=keep)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_mod.attention(*leaves, **kw)
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ex = [t.double().requires_grad_() for t in (q, k, v)]
    exact = reference(*ex, **kw)
    exact_grads = torch.autograd.grad(exact, ex, dout.double())
    lo = [t.clone().requires_grad_() for t in (q, k, v)]
    lowp = reference(*lo, upcast=False, **kw)
    lowp_grads = torch.autograd.grad(lowp, lo, dout)
    assert_within_2x("out", out, exact, lowp, 2e-3)
    for name, g, e, lp in zip(("dq", "dk", "dv"), grads, exact_grads, lowp_grads):
        assert_within_2x(name, g, e, lp, 2e-3)


def test_auto_picks_sdpa_on_cpu_and_bad_cu_seqlens_fail():
    q, k, v = _inputs((10, 2, 8), (10, 2, 8), seed=7)
    from megatron_vlm import _ext

    # auto on CPU: the packed C++ kernel when the extension is built (it hands what it does not take to sdpa)
    with K.use_backends({"attention": "auto"}):
        expected = "csrc" if _ext.available() else "sdpa"
        assert K.DEFAULT_REGISTRY.choose("attention", "cpu", torch.float32) == expected
    with K.use_backends({"attention": "auto"}):
        assert K.DEFAULT_REGISTRY.resolve("attention", q.bfloat16()) is sdpa_mod.attention
    with K.use_backends({"attention": "sdpa"}):
        out = K.attention(q, k, v, causal=True, cu_seqlens_q=cu_seqlens([4, 6]))
    assert max_err(out, reference(q, k, v, causal=True, cu_seqlens_q=cu_seqlens([4, 6]))) <= TOL
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_mod.attention(q, k, v, causal=True, cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
