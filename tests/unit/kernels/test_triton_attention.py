"""Triton flash attention (compiled on CUDA, interpreted on CPU) against the reference: forward and gradients.

Rule: the kernel's error against an fp64 reference is at most 2x the error of the naive reference
computed in the same precision (`upcast=False`: scores, softmax and P @ V rounded to the input
dtype), plus a small absolute floor. A flash kernel reorders the softmax reduction (online
rescaling, blocked sums), so it cannot match the naive result bit for bit, and fixed tolerances
would be too loose for fp32 or too tight for bf16; measuring against what the naive computation in
that precision achieves scales with dtype and length. Shapes are awkward on purpose: lengths 1, 7,
199, varlen batches, GQA / MQA, Sq != Sk, windows, and head dims 64 / 80 (others forward only).
"""
import pytest
import torch
from kernel_checks import DEVICE, assert_within_2x, cu_seqlens, max_err

from megatron_vlm.kernels.reference.attention import attention as reference
from megatron_vlm.kernels.triton import attention as triton_attention

FLOOR = {torch.float32: 2e-5, torch.bfloat16: 2e-3}


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    """The tests below check the Triton kernel itself: no hand-off of dense half-precision blocks to SDPA."""
    monkeypatch.setattr(triton_attention, "DENSE_TO_SDPA", False)


def test_dense_half_precision_blocks_go_to_sdpa_on_cuda(monkeypatch):
    """A batch without mask / window and a one-sample pack (same lengths if causal) in bf16 / fp16 on CUDA go to
    SDPA (measured 2x faster there); packs of several samples, windows, padding masks, fp32 and the CPU do not."""
    from types import SimpleNamespace as T

    monkeypatch.setattr(triton_attention, "DENSE_TO_SDPA", True)
    dense = triton_attention._dense_for_sdpa

    def t(*shape, device="cuda", dtype=torch.bfloat16):
        return T(shape=shape, device=torch.device(device) if device == "cpu" else T(type=device), dtype=dtype,
                 dim=lambda: len(shape))

    one, two = torch.tensor([0, 8]), torch.tensor([0, 3, 8])
    assert dense(t(2, 8, 4, 64), t(2, 8, 2, 64), -1, 0, True, None, None)  # batched causal
    assert dense(t(8, 4, 64, dtype=torch.float16), t(8, 2, 64), -1, -1, False, one, None)  # one-sample pack
    assert not dense(t(5, 4, 64), t(8, 2, 64), -1, -1, False, torch.tensor([0, 5]), None)  # pack, other lengths
    assert dense(t(2, 3, 4, 64), t(2, 8, 2, 64), -1, -1, False, None, None)  # cross lengths, not causal
    assert not dense(t(2, 3, 4, 64), t(2, 8, 2, 64), -1, 0, True, None, None)  # causal, bottom-right aligned
    assert not dense(t(8, 4, 64), t(8, 2, 64), -1, 0, True, two, None)  # several samples
    assert not dense(t(2, 8, 4, 64), t(2, 8, 2, 64), 16, 0, True, None, None)  # window
    assert not dense(t(2, 8, 4, 64), t(2, 8, 2, 64), -1, 0, True, None, torch.ones(2, 8))  # padding mask
    assert not dense(t(2, 8, 4, 64, dtype=torch.float32), t(2, 8, 2, 64), -1, 0, True, None, None)
    assert not dense(t(2, 8, 4, 64, device="cpu"), t(2, 8, 2, 64), -1, 0, True, None, None)
    monkeypatch.setattr(triton_attention, "DENSE_TO_SDPA", False)
    assert not dense(t(2, 8, 4, 64), t(2, 8, 2, 64), -1, 0, True, None, None)


def _check(q, k, v, floor, **kw):
    """Compare output and dq/dk/dv of the kernel with the fp64 and naive low-precision references."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = triton_attention.attention(*leaves, **kw)
    # a seeded cotangent: torch seeds its global generator at random per process, so an unseeded one made the
    # bf16 gradient bounds pass or fail by draw (~1 run in 10 for the padding-mask case)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(123)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    exact_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = reference(*exact_in, **kw)
    exact_grads = torch.autograd.grad(exact, exact_in, dout.double())
    lowp_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lowp = reference(*lowp_in, upcast=False, **kw)
    lowp_grads = torch.autograd.grad(lowp, lowp_in, dout)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_within_2x("out", out, exact, lowp, floor)
    for name, g, e, lp in zip(("dq", "dk", "dv"), grads, exact_grads, lowp_grads):
        assert_within_2x(name, g, e, lp, floor)


def _packed(lens_q, lens_k, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=g).to(DEVICE, dtype)
    return q, k, v, dict(cu_seqlens_q=cu_seqlens(lens_q, DEVICE), cu_seqlens_k=cu_seqlens(lens_k, DEVICE))


def test_triton_kernels_compiled_iff_cuda():
    """tests/conftest.py sets TRITON_INTERPRET before the kernels are decorated: interpreted without
    CUDA, compiled (and the tests' inputs on cuda) with it, unless TRITON_INTERPRET was set by hand."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(triton_attention._attention_fwd_kernel, InterpretedFunction)
    assert interpreted == (DEVICE == "cpu")
    assert interpreted or torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_causal_gqa_lengths_1_7_199(dtype):
    q, k, v, cu = _packed([1, 7, 199], [1, 7, 199], hq=2, hkv=1, d=64, dtype=dtype)
    _check(q, k, v, FLOOR[dtype], causal=True, **cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_noncausal_window_head_dim_80(dtype):
    # vision-tower style: non-causal, windowed, D = 80 (padded to 128 inside the kernel)
    q, k, v, cu = _packed([7, 70], [7, 70], hq=2, hkv=2, d=80, dtype=dtype, seed=1)
    _check(q, k, v, FLOOR[dtype], causal=False, window=(16, 5), **cu)


def test_noncausal_full_and_causal_left_window():
    q, k, v, cu = _packed([130, 1], [130, 1], hq=2, hkv=1, d=64, dtype=torch.float32, seed=2)  # interior blocks need no mask
    _check(q, k, v, FLOOR[torch.float32], causal=False, **cu)
    _check(q, k, v, FLOOR[torch.float32], causal=True, window=(8, -1), softmax_scale=0.05, **cu)


def test_long_windows_mix_masked_and_unmasked_blocks():
    # windows wider than a block: some blocks are interior (mask skipped), some cut by the window edge
    q, k, v, cu = _packed([199], [199], hq=2, hkv=1, d=64, dtype=torch.float32, seed=6)
    _check(q, k, v, FLOOR[torch.float32], causal=True, window=(100, -1), **cu)
    _check(q, k, v, FLOOR[torch.float32], causal=False, window=(90, 70), **cu)


def test_decode_alignment_and_rows_without_keys_mqa():
    # Sq < Sk (decoding with a cache, bottom-right) and Sq > Sk (first rows see no key -> zeros)
    q, k, v, cu = _packed([1, 5, 9], [17, 40, 3], hq=4, hkv=1, d=64, dtype=torch.float32, seed=3)
    _check(q, k, v, FLOOR[torch.float32], causal=True, **cu)
    out = triton_attention.attention(q, k, v, causal=True, **cu)
    assert out[6 : 6 + 6].abs().max() == 0  # sequence 3: rows 0..5 of 9 see no key of 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_left_padding_mask(dtype):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 7, 2, 64, generator=g).to(DEVICE, dtype) for _ in range(3))
    keep = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    keep[0, :3] = False
    _check(q, k, v, FLOOR[dtype], causal=True, key_padding_mask=keep)


def test_batched_cross_lengths_non_causal():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 64, generator=g).to(DEVICE)
    k, v = torch.randn(2, 11, 2, 64, generator=g).to(DEVICE), torch.randn(2, 11, 2, 64, generator=g).to(DEVICE)
    _check(q, k, v, FLOOR[torch.float32], causal=False)


@pytest.mark.parametrize("d", [72, 96, 128])
def test_other_head_dims_forward(d):
    q, k, v, cu = _packed([7, 20], [7, 20], hq=2, hkv=1, d=d, dtype=torch.float32, seed=d)
    out = triton_attention.attention(q, k, v, causal=True, **cu)
    assert max_err(out, reference(q.double(), k.double(), v.double(), causal=True, **cu)) < 1e-5


def test_max_seqlen_hints_and_noncontiguous_inputs():
    # q / k / v as strided slices of one fused qkv projection, as the model produces them
    qkv = torch.randn(26, 3, 2, 64, device=DEVICE)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    cu = cu_seqlens([19, 7], DEVICE)
    out = triton_attention.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=19, max_seqlen_k=19)
    assert max_err(out, reference(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)) < 1e-5


@pytest.mark.parametrize("cu", [[0, 5, 3, 8], [0, 4, 6], [2, 4, 8], [0, 4, 12]])
def test_bad_cu_seqlens_raise_instead_of_reading_out_of_bounds(cu):
    """Decreasing cu_seqlens, or ones not starting at 0 / not ending at the token count, are a ValueError as in
    the other backends (the kernel would read and write outside the tensors: garbage or a heap corruption)."""
    q, k, v = (torch.randn(8, 2, 64, device=DEVICE) for _ in range(3))
    bad = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        triton_attention.attention(q, k, v, causal=True, cu_seqlens_q=bad)


def test_too_small_max_seqlen_hint_raises_on_cpu():
    """A max_seqlen hint shorter than the longest sample would leave rows of the output unwritten; on the CPU
    (interpreted, no device sync to save) the hint is checked against cu_seqlens."""
    if DEVICE != "cpu":
        pytest.skip("on CUDA the hints are trusted (no host sync), as flash-attn does")
    q, k, v = (torch.randn(26, 2, 64) for _ in range(3))
    cu = cu_seqlens([19, 7])
    with pytest.raises(ValueError, match="max_seqlen"):
        triton_attention.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
