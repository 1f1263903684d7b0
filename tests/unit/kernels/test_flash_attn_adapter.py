"""The flash-attn adapter (`kernels/thirdparty/flash_attn.py`).

On the CPU (always): the adapter's argument translation is checked against a stand-in `flash_attn`
module written here from flash-attn's documented semantics (layouts [B, S, H, D] / packed [T, H, D]
with cumulative `cu_seqlens`, GQA by head groups, bottom-right causal alignment, `window_size =
(left, right)` with -1 unbounded, and causal meaning "right = 0"), computed the plain way per sequence
and per head. The stand-in also makes the package's own checks and rewrites, read in flash-attn 2.8.4
(the same in 2.7.4 - 2.8.3): its Python wrapper (flash_attn/flash_attn_interface.py: the default scale from
the unpadded head dim, the head dim padded to a multiple of 8, `maybe_contiguous`, `int` max_seqlen in the
custom-op schema) and its C++ (csrc/flash_attn/flash_api.cpp, mha_fwd / mha_varlen_fwd: GPU capability >= 8,
fp16 / bf16, head dim <= 256, Hkv | Hq, batch > 0, cu_seqlens int32 / contiguous / on q's device, the window
rewrites, the GQA decoding reshape, a non-empty launch grid), so a call the real package would refuse fails
here, and the adapter's fallbacks (to our SDPA backend, logged with their reason) are checked against the
reference. On a GPU with flash-attn installed (`gpu` marker): the real package against our reference, within
the rule of the low-precision attention tests (error at most 2x that of the reference computed naively in the
same dtype, plus a small floor).
"""
from __future__ import annotations

import logging
import math
import sys
import types

import numpy as np
import pytest
import torch

from megatron_vlm.kernels.reference.attention import attention as reference_attention
from megatron_vlm.kernels.thirdparty import flash_attn as adapter

_HALF = (torch.float16, torch.bfloat16)


def _one_sequence(q, k, v, scale, left, right):
    """q [Sq, Hq, D], k / v [Sk, Hkv, D] -> [Sq, Hq, D] in fp64: the kernels' mask (csrc/flash_attn/src/mask.h,
    bottom-right with this sequence's lengths; a side < 0 is unbounded), rows without keys -> 0 (softmax.h)."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
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


def _fake_flash_attn(gpu):
    """`gpu`: {"capability": (major, minor)}, the GPU the stand-in pretends to run on."""
    mod = types.ModuleType("flash_attn")
    calls = []

    # flash_attn/flash_attn_interface.py: FlashAttn(Varlen)Func.forward and _flash_attn_(varlen_)forward
    def wrapper(q, k, v, softmax_scale):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)  # before the padding below
        head_size_og = q.shape[-1]
        if head_size_og % 8 != 0:
            q, k, v = (torch.nn.functional.pad(t, [0, 8 - head_size_og % 8]) for t in (q, k, v))
        q, k, v = (t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, v))  # maybe_contiguous
        return q, k, v, softmax_scale, head_size_og

    def schema_int(value, name):
        # the torch.library.custom_op schema declares `int` (a float is refused); the stand-in asks for a Python int
        assert type(value) is int, f"{name} must be an int, got {type(value).__name__}"

    # csrc/flash_attn/flash_api.cpp: the checks mha_fwd and mha_varlen_fwd share
    def common_checks(q, k, v):
        assert gpu["capability"][0] >= 8, "FlashAttention only supports Ampere GPUs or newer."
        assert q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type"
        assert k.dtype == q.dtype, "query and key must have the same dtype"
        assert v.dtype == q.dtype, "query and value must have the same dtype"
        assert q.device == k.device == v.device  # CHECK_DEVICE (is_cuda); here: all on the stand-in's device
        for t in (q, k, v):
            assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"

    def head_checks(head_size, num_heads, num_heads_k):
        assert head_size <= 256, "FlashAttention forward only supports head dimension at most 256"
        assert head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8"
        assert num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query"

    def unbound_beyond(left, right, seqlen_k):
        # mha_fwd / mha_varlen_fwd: a window side >= seqlen_k (varlen: max_seqlen_k) becomes -1
        return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_k else right)

    def set_params_window(left, right, seqlen_k):
        # set_params_fprop: a window bounded on one side only gets seqlen_k on the other
        if left < 0 and right >= 0:
            left = seqlen_k
        if left >= 0 and right < 0:
            right = seqlen_k
        return left, right

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        calls.append(("batched", causal, tuple(window_size)))
        left, right = window_size
        schema_int(left, "window_size_left")
        schema_int(right, "window_size_right")
        q, k, v, scale, head_size_og = wrapper(q, k, v, softmax_scale)
        # mha_fwd
        common_checks(q, k, v)
        batch_size, seqlen_q, num_heads, head_size = q.shape
        seqlen_k, num_heads_k = k.shape[1], k.shape[2]
        assert batch_size > 0, "batch size must be positive"
        head_checks(head_size, num_heads, num_heads_k)
        left, right = unbound_beyond(left, right, seqlen_k)
        if seqlen_q == 1:
            causal = False  # "causal=true is the same as causal=false in this case"
        if causal:
            right = 0
        assert k.shape == (batch_size, seqlen_k, num_heads_k, head_size) and v.shape == k.shape  # CHECK_SHAPE
        left, right = set_params_window(left, right, seqlen_k)
        out = torch.zeros(q.shape, dtype=torch.float64)
        if seqlen_k > 0:  # else "we need to set the output to 0"
            # run_flash_fwd launches grid(ceil(seqlen_q / kBlockM), b, h): an empty one fails to launch
            assert seqlen_q > 0 and num_heads > 0, "CUDA error: invalid configuration argument"
            out = torch.stack([_one_sequence(q[b], k[b], v[b], scale, left, right) for b in range(batch_size)])
        return out[..., :head_size_og].to(q.dtype)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        calls.append(("varlen", causal, tuple(window_size), max_seqlen_q, max_seqlen_k))
        left, right = window_size
        for value, name in ((max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k"), (left, "window_size_left"),
                            (right, "window_size_right")):
            schema_int(value, name)
        q, k, v, scale, head_size_og = wrapper(q, k, v, softmax_scale)
        # mha_varlen_fwd
        common_checks(q, k, v)
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            assert cu.dtype == torch.int32, f"{name} must have dtype int32"
            assert cu.device == q.device, f"{name} must be on CUDA"  # CHECK_DEVICE
            assert cu.is_contiguous(), f"{name} must be contiguous"  # CHECK_CONTIGUOUS
        batch_size = cu_seqlens_q.numel() - 1
        total_q, num_heads, head_size = q.shape
        num_heads_k = k.shape[1]
        if max_seqlen_q == 1:
            causal = False
        if causal:
            right = 0
        if max_seqlen_q == 1 and num_heads > num_heads_k and left < 0 and right < 0:  # seqlenq_ngroups_swapped
            # q.reshape({batch_size, num_heads_k, ngroups, head_size}): one query per sequence, or it throws
            q.reshape(batch_size, num_heads_k, num_heads // num_heads_k, head_size)
        assert batch_size > 0, "batch size must be positive"
        head_checks(head_size, num_heads, num_heads_k)
        left, right = unbound_beyond(left, right, max_seqlen_k)
        assert k.shape == (k.shape[0], num_heads_k, head_size) and v.shape == k.shape  # CHECK_SHAPE
        assert cu_seqlens_q.shape == (batch_size + 1,) and cu_seqlens_k.shape == (batch_size + 1,)
        left, right = set_params_window(left, right, max_seqlen_k)
        parts = []
        for s in range(batch_size):
            a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            c, e = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            # not a check of the package: its kernels size the grid (and the window clamp) from the hints, so a
            # hint shorter than a sequence gives wrong numbers
            assert b - a <= max_seqlen_q and e - c <= max_seqlen_k
            parts.append(_one_sequence(q[a:b], k[c:e], v[c:e], scale, left, right))
        if max_seqlen_k > 0:
            assert max_seqlen_q > 0 and num_heads > 0, "CUDA error: invalid configuration argument"  # run_flash_fwd
        return torch.cat(parts)[..., :head_size_og].to(q.dtype)

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod, calls


@pytest.fixture
def gpu(monkeypatch):
    """The GPU the stand-in runs on; the adapter reads its capability through `_gpu_capability`."""
    state = {"capability": (9, 0)}
    monkeypatch.setattr(adapter, "_gpu_capability", lambda device_type, index: state["capability"])
    return state


@pytest.fixture
def fake_flash_attn(monkeypatch, gpu):
    mod, calls = _fake_flash_attn(gpu)
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    adapter._logged.clear()
    return calls


def _packed(lengths_q, lengths_k, hq, hkv, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), hkv, d, generator=g).to(dtype)
    cu = [torch.tensor([0, *np.cumsum(n).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def _batched(b, sq, sk, hq, hkv, d, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _exact(q, k, v, **kwargs):
    """The reference on the same (rounded) values in fp64, rounded to q's dtype like the stand-in's output."""
    return reference_attention(q.double(), k.double(), v.double(), **kwargs).to(q.dtype)


def _close(got, want):
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", _HALF)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, -1)), (False, (2, 4))])
def test_packed_translation_matches_reference(fake_flash_attn, causal, window, dtype):
    lengths = [1, 7, 12]
    q, k, v, cu, _ = _packed(lengths, lengths, 4, 2, 16, dtype)
    got = adapter.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=window, softmax_scale=0.3)
    _close(got, _exact(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, window=window, softmax_scale=0.3))
    kind, _, _, max_q, max_k = fake_flash_attn[-1]
    assert kind == "varlen" and max_q == max_k == max(lengths)


def test_batched_decoding_shape_matches_reference(fake_flash_attn):
    """Sq < Sk (decoding against a cache): bottom-right alignment must survive the translation."""
    q, k, v = _batched(2, 3, 9, 4, 1, 8)
    got = adapter.attention(q, k, v, causal=True, window=(4, -1))
    _close(got, _exact(q, k, v, causal=True, window=(4, -1)))
    assert fake_flash_attn[-1] == ("batched", True, (4, -1))


def test_cross_lengths_head_dim_padding_and_default_scale(fake_flash_attn):
    """Packed cross-attention (query / key lengths differ, a sequence without queries, Sq > Sk rows that see no
    key), a head dim of 12 (the wrapper pads it to 16 and slices the output) with the default scale (taken from
    the unpadded dim, as ours: 12 ** -0.5) and a q that is not contiguous over its head dim (the wrapper copies it)."""
    q, k, v, cu_q, cu_k = _packed([3, 0, 5], [2, 4, 6], 6, 2, 12, torch.bfloat16, seed=3)
    q = q.transpose(0, 2).contiguous().transpose(0, 2)  # stride 1 over tokens, not over the head dim
    assert q.stride(-1) != 1
    for causal in (True, False):
        got = adapter.attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        _close(got, _exact(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert [c[0] for c in fake_flash_attn] == ["varlen", "varlen"]
    b = _batched(2, 5, 3, 4, 4, 12, torch.bfloat16)
    _close(adapter.attention(*b, causal=True), _exact(*b, causal=True))  # rows 0-1 see no key: zeros


def test_cu_seqlens_and_hints_are_realigned(fake_flash_attn):
    """flash-attn needs contiguous int32 cu_seqlens on q's device and `int` max_seqlen (its custom-op schema): a
    strided cu_seqlens view is made contiguous, numpy / tensor hints become ints."""
    q, k, v, cu, _ = _packed([4, 2, 6], [4, 2, 6], 4, 4, 8)
    strided = torch.stack([cu, cu], 1).reshape(-1)[::2]
    assert torch.equal(strided, cu) and not strided.is_contiguous()
    want = _exact(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _close(adapter.attention(q, k, v, causal=True, cu_seqlens_q=strided), want)
    other = torch.stack([cu, cu], 1).reshape(-1)[1::2]  # a second strided view, for cu_seqlens_k
    got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=strided, cu_seqlens_k=other,
                            max_seqlen_q=np.int64(6), max_seqlen_k=torch.tensor(6))
    _close(got, want)
    assert fake_flash_attn[-1] == ("varlen", True, (-1, -1), 6, 6)


@pytest.mark.parametrize("cu", [[0, 5, 3, 8], [0, 4, 6], [2, 4, 8], [0, 4, 12]])
def test_bad_cu_seqlens_raise_before_the_kernel(fake_flash_attn, cu):
    """Without max_seqlen hints the adapter reads the lengths on the host anyway; that read also checks them, so
    decreasing / shifted / short cu_seqlens are the ValueError of the other backends, not a kernel reading outside
    q / k / v (flash-attn does not check them)."""
    q, k, v, _, _ = _packed([4, 4], [4, 4], 4, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        adapter.attention(q, k, v, causal=True, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    assert not fake_flash_attn


def test_the_stand_in_refuses_what_the_package_refuses(fake_flash_attn, gpu):
    """Calls made straight to the stand-in (not through the adapter) that flash-attn's checks refuse."""
    fa = sys.modules["flash_attn"]
    q, k, v, cu, _ = _packed([3, 5], [3, 5], 4, 2, 8)
    ok = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    fa.flash_attn_varlen_func(q, k, v, **ok)
    refused = {
        "dtype": lambda: fa.flash_attn_varlen_func(q.float(), k.float(), v.float(), **ok),
        "int64": lambda: fa.flash_attn_varlen_func(q, k, v, **{**ok, "cu_seqlens_q": cu.long()}),
        "contiguous": lambda: fa.flash_attn_varlen_func(q, k, v, **{**ok, "cu_seqlens_k": torch.stack([cu, cu], 1)[:, 0]}),
        "float hint": lambda: fa.flash_attn_varlen_func(q, k, v, **{**ok, "max_seqlen_q": 5.0}),
        "head dim": lambda: fa.flash_attn_varlen_func(*(t.new_zeros(t.shape[0], t.shape[1], 264) for t in (q, k, v)), **ok),
        "heads": lambda: fa.flash_attn_varlen_func(q[:, :3], k, v, **ok),
        "batch": lambda: fa.flash_attn_func(*(t.new_zeros(0, 3, t.shape[1], 8) for t in (q, k, v))),
        "empty grid": lambda: fa.flash_attn_func(q.new_zeros(1, 0, 4, 8), k[None], v[None]),
        "gqa decoding": lambda: fa.flash_attn_varlen_func(
            q[:2], k, v, torch.tensor([0, 1, 1, 2], dtype=torch.int32), torch.tensor([0, 2, 4, 8], dtype=torch.int32), 1, 4),
    }
    for name, call in refused.items():
        with pytest.raises((AssertionError, RuntimeError)):
            call()
            pytest.fail(f"the stand-in took the {name} call")
    gpu["capability"] = (7, 5)
    with pytest.raises(AssertionError, match="Ampere"):
        fa.flash_attn_varlen_func(q, k, v, **ok)


def test_calls_flash_attn_refuses_run_sdpa_and_say_why(fake_flash_attn, gpu, caplog):
    """fp32, a head dim over 256, no query, a pre-Ampere GPU: SDPA (our `sdpa` backend), logged once per reason."""
    q, k, v, cu, _ = _packed([3, 5], [3, 5], 4, 2, 8)
    b = _batched(1, 2, 3, 2, 2, 264)
    empty = (q[:0], k, v)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        for _ in range(2):
            got = adapter.attention(q.float(), k.float(), v.float(), causal=True, cu_seqlens_q=cu)
            _close(got, _exact(q.float(), k.float(), v.float(), causal=True, cu_seqlens_q=cu))
        _close(adapter.attention(*b, causal=False), _exact(*b, causal=False))
        got = adapter.attention(*empty, causal=True, cu_seqlens_q=torch.tensor([0, 0], dtype=torch.int32),
                                cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32))
        assert got.shape == (0, 4, 8)
        gpu["capability"] = (7, 5)
        _close(adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu), _exact(q, k, v, causal=True, cu_seqlens_q=cu))
    assert fake_flash_attn == []
    text = caplog.text
    assert text.count("dtype torch.float32") == 1
    assert "head dim 264" in text and "no query element" in text and "compute capability 7.5" in text
    assert "falls back to torch SDPA" in text


def test_a_cpu_tensor_without_the_stand_ins_gpu_runs_sdpa(caplog, monkeypatch):
    """Unpatched: off CUDA there is no capability to read, and the call runs SDPA (logged)."""
    assert adapter._gpu_capability("cpu", None) is None
    monkeypatch.setattr(adapter, "_logged", set())
    q, k, v = _batched(1, 4, 4, 2, 2, 8)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        _close(adapter.attention(q, k, v, causal=True), _exact(q, k, v, causal=True))
    assert "tensor on cpu" in caplog.text


@pytest.mark.parametrize("window,rewritten", [((1, -1), True), ((-1, 3), True), ((1, 2), False), ((1, 1), False)])
def test_windows_flash_attn_would_rewrite_run_sdpa(fake_flash_attn, caplog, window, rewritten):
    """Sq = 8 > Sk + 1 = 3, non-causal: flash-attn turns a right side of -1 (with a bounded left one) into Sk and
    one >= Sk (here 3) into -1 (with an unbounded left one), which changes what the first rows see (the
    stand-in, called directly, shows it); the adapter sends those to SDPA. (1, 2) becomes (1, -1) and then
    (1, 2) again, (1, 1) is kept: both go to flash-attn."""
    q, k, v = _batched(2, 8, 2, 2, 1, 8)
    want = _exact(q, k, v, causal=False, window=window)
    direct = sys.modules["flash_attn"].flash_attn_func(q, k, v, window_size=window)
    assert ((direct.double() - want.double()).abs().max() > 0.1) == rewritten
    fake_flash_attn.clear()
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        got = adapter.attention(q, k, v, causal=False, window=window)
        _close(got, want)
        q, k, v, cu_q, cu_k = _packed([8, 1], [2, 2], 2, 1, 8, seed=4)
        got = adapter.attention(q, k, v, causal=False, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        _close(got, _exact(q, k, v, causal=False, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    if rewritten:
        assert fake_flash_attn == [] and "a non-causal window" in caplog.text
    else:
        assert [c[:3] for c in fake_flash_attn] == [("batched", False, window), ("varlen", False, window)]


def test_packed_gqa_decoding_with_an_empty_query_sequence_runs_sdpa(fake_flash_attn, caplog):
    """max_seqlen_q == 1 with GQA and no window: flash-attn reshapes q to one query per sequence; a pack where
    a sequence has no query would fail there -> SDPA. With one query everywhere it goes to flash-attn."""
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        for lengths_q in ([1, 1, 1], [1, 0, 1]):
            q, k, v, cu_q, cu_k = _packed(lengths_q, [3, 2, 4], 4, 2, 8, seed=5)
            got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            _close(got, _exact(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert fake_flash_attn == [("varlen", True, (-1, -1), 1, 4)] and "packed GQA decoding" in caplog.text


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
    ref_err = (naive.double() - exact).abs().max().item()
    for cu_given in (cu, cu.cpu()):  # cu_seqlens on the CPU: moved to q's device by the adapter
        got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu_given, cu_seqlens_k=cu_given)
        err = (got.double() - exact).abs().max().item()
        assert math.isfinite(err) and err <= 2 * ref_err + 1e-3, (err, ref_err)


def test_a_call_it_hands_to_sdpa_compiles_without_a_graph_break(monkeypatch):
    """The once-per-reason log of a fallback runs outside the trace: a compiled block whose attention falls back
    (here: tensors on the CPU) keeps one graph (fullgraph), where a log call inside the trace broke it."""
    import megatron_vlm.kernels.sdpa.attention as sdpa_mod
    from megatron_vlm.kernels.thirdparty import flash_attn as fa

    torch._dynamo.reset()
    monkeypatch.setattr(sdpa_mod, "attention", lambda q, k, v, **kw: q * 2 + v)  # traceable stand-in for SDPA
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)

    def block(q):
        return fa.attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)

    torch.testing.assert_close(torch.compile(block, backend="eager", fullgraph=True)(q), q * 3)
