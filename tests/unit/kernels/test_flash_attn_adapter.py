"""The flash-attn adapter (`kernels/thirdparty/flash_attn.py`).

On the CPU (always): the adapter's argument translation is checked against a stand-in `flash_attn`
module written here from flash-attn's documented semantics (layouts [B, S, H, D] / packed [T, H, D]
with cumulative `cu_seqlens`, GQA by head groups, bottom-right causal alignment, `window_size =
(left, right)` with -1 unbounded, and causal meaning "right = 0"), computed the plain way per sequence
and per head. On a GPU with flash-attn installed (`gpu` marker): the real package against our
reference, within the rule of the low-precision attention tests (error at most 2x that of the
reference computed naively in the same dtype, plus a small floor).
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megatron_vlm.kernels.reference.attention import attention as reference_attention
from megatron_vlm.kernels.thirdparty import flash_attn as adapter


def _one_sequence(q, k, v, scale, causal, window):
    """q [Sq, Hq, D], k / v [Sk, Hkv, D] -> [Sq, Hq, D], flash-attn's documented masking."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(sq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)].double(), v[:, h // (hq // hkv)].double()
        for i in range(sq):
            centre = i + sk - sq
            allowed = [j for j in range(sk) if (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)]
            if not allowed:
                continue
            scores = torch.stack([(q[i, h].double() * kh[j]).sum() * scale for j in allowed])
            p = torch.softmax(scores, 0)
            out[i, h] = (p[:, None] * vh[allowed]).sum(0)
    return out


def _fake_flash_attn():
    mod = types.ModuleType("flash_attn")
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
        calls.append(("batched", causal, tuple(window_size)))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return torch.stack([_one_sequence(q[b], k[b], v[b], scale, causal, window_size) for b in range(q.shape[0])]).to(q.dtype)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, window_size=(-1, -1)):
        calls.append(("varlen", causal, tuple(window_size), int(max_seqlen_q), int(max_seqlen_k)))
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        parts = []
        for s in range(cu_seqlens_q.numel() - 1):
            a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            c, e = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            assert b - a <= max_seqlen_q and e - c <= max_seqlen_k
            parts.append(_one_sequence(q[a:b], k[c:e], v[c:e], scale, causal, window_size))
        return torch.cat(parts).to(q.dtype)

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod, calls


@pytest.fixture
def fake_flash_attn(monkeypatch):
    mod, calls = _fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    return calls


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, -1)), (False, (2, 4))])
def test_packed_translation_matches_reference(fake_flash_attn, causal, window):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 12]
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(total, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(total, 2, 16, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 1, 8, 20], dtype=torch.int32)
    got = adapter.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=window, softmax_scale=0.3)
    want = reference_attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=window, softmax_scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    kind, _, _, max_q, max_k = fake_flash_attn[-1]
    assert kind == "varlen" and max_q == max_k == max(lengths)


def test_batched_decoding_shape_matches_reference(fake_flash_attn):
    """Sq < Sk (decoding against a cache): bottom-right alignment must survive the translation."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 9, 1, 8, generator=g, dtype=torch.float64)
    got = adapter.attention(q, k, v, causal=True, window=(4, -1))
    want = reference_attention(q, k, v, causal=True, window=(4, -1))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert fake_flash_attn[-1] == ("batched", True, (4, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_flash_attn_on_gpu(dtype):
    pytest.importorskip("flash_attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 77, 199, 256]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, 8, 128, device="cuda", generator=g).to(dtype)
    k = torch.randn(total, 2, 128, device="cuda", generator=g).to(dtype)
    v = torch.randn(total, 2, 128, device="cuda", generator=g).to(dtype)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    naive = reference_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, upcast=False)
    got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    err = (got.double() - exact).abs().max().item()
    ref_err = (naive.double() - exact).abs().max().item()
    assert math.isfinite(err) and err <= 2 * ref_err + 1e-3, (err, ref_err)
