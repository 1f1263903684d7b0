"""The `torch_varlen` attention backend (torch's flash varlen kernel) mapped onto our contract.

torch's `varlen_attn` runs on CUDA only, so on the CPU the adapter is driven through stand-ins with the two
signatures torch releases have had (`is_causal=` in 2.10 / 2.11; `window_size=` / `scale=` / `enable_gqa=`
later). Each stand-in computes what varlen_attn documents (per-sequence softmax attention, bottom-right causal,
GQA only through `enable_gqa`) from plain torch ops, so a wrong mapping (causal lost, GQA heads mis-paired,
a window or scale dropped) shows up against our reference. On a GPU the real kernel is compared too.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.kernels.reference.attention import attention as reference
from megatron_vlm.kernels.torch_fused import varlen_attention as backend


def _dense(q, k, v, causal, left, right, scale):
    """[S, H, D] one sequence; window (left, right) -1 = unbounded."""
    s = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _new_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    if key.shape[1] != query.shape[1]:
        assert enable_gqa, "GQA without enable_gqa"
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        left, right = window_size
        out.append(_dense(query[a:b], key[a:b], value[a:b], right == 0, left, right, scale))
    return torch.cat(out)


def _old_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert key.shape[1] == query.shape[1], "this release has no GQA"
    return _new_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0 if is_causal else -1))


def _use(monkeypatch, fn):
    import inspect

    monkeypatch.setattr(backend, "_varlen", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    monkeypatch.setattr(backend, "check", lambda device_type, dtype: None)


def _case(lengths, hq, hkv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("style", [_new_style, _old_style])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_packed_matches_the_reference(monkeypatch, style, causal, hq, hkv):
    _use(monkeypatch, style)
    q, k, v, cu = _case([5, 1, 9, 3], hq, hkv)
    got = backend.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    exp = reference(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("style,called", [(_new_style, True), (_old_style, False)])
def test_window_and_scale_go_where_the_release_takes_them(monkeypatch, style, called):
    calls = []

    def spy(*a, **kw):
        calls.append(kw)
        return style(*a, **kw)

    spy.__signature__ = __import__("inspect").signature(style)
    _use(monkeypatch, spy)
    q, k, v, cu = _case([7, 11], 2, 2)
    for kwargs in ({"window": (2, 3)}, {"softmax_scale": 0.3}):
        calls.clear()
        got = backend.attention(q, k, v, causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu, **kwargs)
        exp = reference(q, k, v, causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu, **kwargs)
        torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
        assert bool(calls) == called, kwargs  # old release: SDPA fallback, never a silently dropped argument


@pytest.mark.parametrize("bad", [[0, 5, 3, 8], [0, 4, 6], [2, 4, 8], [0, 4, 12]])
def test_bad_cu_seqlens_raise_before_the_kernel(monkeypatch, bad):
    """Without a max_seqlen hint the adapter reads the longest sample on the host; that read also checks
    cu_seqlens (the ValueError of the other backends), so the kernel never gets decreasing / shifted / short ones."""
    def never(*a, **kw):
        raise AssertionError("the kernel was called")

    never.__signature__ = __import__("inspect").signature(_new_style)  # a release the adapter maps every call to
    _use(monkeypatch, never)
    q, k, v, _ = _case([4, 4], 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        backend.attention(q, k, v, causal=True, cu_seqlens_q=torch.tensor(bad, dtype=torch.int32))


def test_other_layouts_fall_back_to_sdpa(monkeypatch):
    def never(*a, **kw):
        raise AssertionError("varlen_attn called for a layout it does not take")

    _use(monkeypatch, never)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(backend.attention(q, k, v, causal=True), reference(q, k, v, causal=True))
    q, k, v, cu_q = _case([4, 4], 2, 2)
    cu_k = torch.tensor([0, 3, 8], dtype=torch.int32)
    got = backend.attention(q, k, v, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(got, reference(q, k, v, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def test_check_refuses_cpu_and_fp32():
    assert "CUDA" in backend.check("cpu", torch.bfloat16)
    assert "float32" in backend.check("cuda", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_real_kernel_on_the_gpu(causal):
    if backend.check("cuda", torch.bfloat16) is not None:
        pytest.skip(backend.check("cuda", torch.bfloat16))
    q, k, v, cu = _case([300, 17, 1000, 64], 16, 2, d=128)
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    cu = cu.cuda()
    got = backend.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref32 = reference(*(t.float() for t in (q, k, v)), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref16 = reference(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    err, ref_err = (got.float() - ref32).abs().max().item(), (ref16.float() - ref32).abs().max().item()
    assert err <= 2 * ref_err + 1e-3, (err, ref_err)
    up = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v), up)
    g16 = torch.autograd.grad(ref16, (q, k, v), up)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref32 = reference(q32, k32, v32, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    g32 = torch.autograd.grad(ref32, (q32, k32, v32), up.float())
    for a, b, c in zip(g_got, g16, g32):  # ours within 2x the bf16 reference's own error (+ a floor)
        assert (a.float() - c).abs().max().item() <= 2 * (b.float() - c).abs().max().item() + 1e-2


def _register_stand_in_op(name, style):
    """A CPU custom op standing in for torch's `torch_attn::_varlen_attn` (an opaque op with a fake and an autograd
    formula there too), wrapped in a Python function of the release's signature."""
    lib_name = f"mvlm_test_varlen::{name}"

    @torch.library.custom_op(lib_name, mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool) -> torch.Tensor:
        return _new_style(q, k, v, cu, cu, 0, 0, window_size=(-1, 0 if causal else -1)).contiguous()

    @op.register_fake
    def _(q, k, v, cu, causal):
        return torch.empty_like(q)

    def backward(ctx, grad):
        q, k, v, cu = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _new_style(*leaves, cu, cu, 0, 0, window_size=(-1, 0 if ctx.causal else -1))
            return (*torch.autograd.grad(out, leaves, grad), None, None)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:4])
        ctx.causal = inputs[4]

    op.register_autograd(backward, setup_context=setup)
    if style == "old":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return op(query, key, value, cu_seq_q, is_causal)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            assert window_size[0] == -1 and (enable_gqa or key.shape[1] == query.shape[1])
            if key.shape[1] != query.shape[1]:
                rep = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
            return op(query, key, value, cu_seq_q, window_size[1] == 0)
    return varlen_attn


@pytest.mark.parametrize("style", ["old", "new"])
def test_compiles_fullgraph_with_the_hint_and_matches_eager(monkeypatch, request, style):
    """The compiled training blocks call the adapter with a max_seqlen hint: it must trace without a graph break
    (no host read, no untraceable Python) and give eager's outputs and gradients."""
    torch._dynamo.reset()
    import torch.nn.attention.varlen as torch_varlen

    # the adapter's own lookup of torch's function (cached, signature read once) is traced too
    monkeypatch.setattr(torch_varlen, "varlen_attn", _register_stand_in_op(f"attn_{style}", style))
    monkeypatch.setattr(backend, "check", lambda device_type, dtype: None)
    backend._found.clear()
    request.addfinalizer(backend._found.clear)
    q, k, v, cu = _case([5, 9, 2], 4, 2, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def block(q, k, v, cu):
        return backend.attention(q * 1.5, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                 max_seqlen_k=9).sin()

    eager = block(q, k, v, cu)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(q, k, v, cu)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(eager, reference(q * 1.5, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu).sin())
    up = torch.randn_like(eager)
    for a, e in zip(torch.autograd.grad(compiled, (q, k, v), up), torch.autograd.grad(eager, (q, k, v), up)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("triton_runs", [True, False])
def test_calls_it_cannot_take_go_to_our_triton_kernel_where_it_runs(monkeypatch, triton_runs):
    """`auto` takes this backend on CUDA above our Triton kernel: what varlen_attn cannot take (the prompt-shared
    packs' separate key lengths, a window the release has no argument for) must reach the kernel `auto` took
    before, not SDPA with a dense mask; where Triton cannot run, SDPA."""
    import megatron_vlm.kernels.availability as availability
    import megatron_vlm.kernels.sdpa.attention as sdpa_mod
    import megatron_vlm.kernels.triton.attention as triton_mod

    def never(*a, **kw):
        raise AssertionError("varlen_attn called for a call it cannot take")

    never.__signature__ = __import__("inspect").signature(_old_style)
    _use(monkeypatch, never)
    calls = []

    def spy(name):
        def run(q, k, v, **kw):
            calls.append(name)
            return reference(q, k, v, **kw)
        return run

    monkeypatch.setattr(availability, "triton_check", lambda device_type, dtype: None if triton_runs else "no triton")
    monkeypatch.setattr(triton_mod, "attention", spy("triton"))
    monkeypatch.setattr(sdpa_mod, "attention", spy("sdpa"))
    q, k, v, cu = _case([4, 6], 2, 2, seed=5)
    # separate key cu_seqlens (a prompt-shared pack's keys): same lengths here, still not mapped (no host read)
    got = backend.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu.clone())
    torch.testing.assert_close(got, reference(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu))
    got = backend.attention(q, k, v, causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(1, 2))
    torch.testing.assert_close(got, reference(q, k, v, causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(1, 2)))
    assert calls == ["triton" if triton_runs else "sdpa"] * 2


@pytest.mark.parametrize("layout", ["separate_key_lengths", "batched"])
def test_calls_it_hands_to_triton_compile_without_a_graph_break(monkeypatch, layout):
    """The prompt-shared packs' layers (separate key cu_seqlens) and batched calls in a compiled block: the hand-over
    to our Triton kernel (interpreted here, a custom op as on CUDA) traces whole; its once-per-reason log and the
    availability probe are not traced (each broke the graph in every layer)."""
    from megatron_vlm.kernels.availability import triton_check

    if triton_check("cpu", torch.float64) is not None:
        pytest.skip("needs the Triton interpreter")
    torch._dynamo.reset()
    _use(monkeypatch, _new_style)
    monkeypatch.setattr(backend, "_logged", set())  # the first call logs: that must not be traced either
    if layout == "batched":
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(2, 6, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        kw: dict = {}
    else:
        q, k, v, cu = _case([5, 9, 2], 4, 2, seed=7)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=9, max_seqlen_k=9)

    def block(q, k, v, kw):
        return backend.attention(q * 1.5, k, v, causal=True, **kw).sin()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(q, k, v, kw)
    exp = reference(q * 1.5, k, v, causal=True, **{n: t for n, t in kw.items() if n.startswith("cu")}).sin()
    torch.testing.assert_close(compiled, exp, atol=1e-5, rtol=1e-5)
    assert backend._logged  # logged once, eagerly
