"""Packed varlen attention on the C++ CPU kernel (kernels/csrc/attention.py) against the float64 torch reference
(kernels/reference/attention.py): outputs and q / k / v gradients, causal and full, GQA, samples whose query and key
counts differ (a completion continuing a shared prompt: more keys than queries; and fewer), empty samples; the
cases the kernel does not take run the sdpa backend."""
import importlib

import pytest
import torch

from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

ref = importlib.import_module("megatron_vlm.kernels.reference.attention")
sdpa = importlib.import_module("megatron_vlm.kernels.sdpa.attention")


@pytest.fixture
def csrc_attention(ext):
    return importlib.import_module("megatron_vlm.kernels.csrc.attention")


def _pack(lens_q, lens_k, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.randn(t, h, d, generator=g) for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


def _run(fn, q, k, v, cu_q, cu_k, causal, dtype, seed=1):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return (out, *torch.autograd.grad(out, leaves, cot))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (2, 2, 128), (6, 3, 16)])
def test_matches_float64_reference(csrc_attention, causal, hq, hkv, d):
    lens_q = [5, 31, 1, 0, 17, 12]
    lens_k = [5, 46, 1, 0, 17, 7]  # sample 1: 15 prompt keys before its 31 queries; sample 5: fewer keys than queries
    q, k, v, cu_q, cu_k = _pack(lens_q, lens_k, hq, hkv, d, seed=hq + d)
    got = _run(csrc_attention.attention, q, k, v, cu_q, cu_k, causal, torch.float32)
    want = _run(ref.attention, q, k, v, cu_q, cu_k, causal, torch.float64)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-6 * max(b.abs().max().item(), 1.0), err
    if causal:  # sample 5, queries 0-4 see no key (12 queries, 7 keys, bottom-right): zeros, zero gradient
        q0 = sum(lens_q[:5])
        assert not got[0][q0:q0 + 5].any() and not got[1][q0:q0 + 5].any()


def test_equals_sdpa_backend_to_rounding_and_is_picked_on_cpu(csrc_attention):
    q, k, v, cu_q, cu_k = _pack([8, 3, 20], [8, 3, 20], 4, 2, 64, seed=3)
    got = _run(csrc_attention.attention, q, k, v, cu_q, cu_k, True, torch.float32)
    want = _run(sdpa.attention, q, k, v, cu_q, cu_k, True, torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert DEFAULT_REGISTRY.choose("attention", "cpu", torch.float32) == "csrc"
    assert DEFAULT_REGISTRY.choose("attention", "cpu", torch.bfloat16) == "sdpa"


def test_other_cases_run_sdpa_bitwise(csrc_attention):
    q, k, v, cu_q, cu_k = _pack([6, 9], [6, 9], 2, 1, 64, seed=4)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for extra in ({"window": (3, 0)}, {"max_seqlen_k": csrc_attention.MAX_SEQLEN + 1}):
        assert torch.equal(csrc_attention.attention(q, k, v, **kw, **extra), sdpa.attention(q, k, v, **kw, **extra))
    qb, kb, vb = q[None, :6], k[None, :6], v[None, :6]  # batched [B, S, H, D]
    assert torch.equal(csrc_attention.attention(qb, kb, vb, causal=True), sdpa.attention(qb, kb, vb, causal=True))
    q36, k36, v36 = (t[..., :36] for t in (q, k, v))  # head dim not a multiple of 8
    assert torch.equal(csrc_attention.attention(q36, k36, v36, **kw), sdpa.attention(q36, k36, v36, **kw))
    with pytest.raises(ValueError):  # the reference's checks: cu_seqlens that do not end at the token count
        csrc_attention.attention(q, k, v, causal=True, cu_seqlens_q=torch.tensor([0, 6, 14], dtype=torch.int32), cu_seqlens_k=cu_k)
    bad = torch.tensor([0, 9, 6, 15], dtype=torch.int32)  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        csrc_attention.attention(q, k, v, causal=True, cu_seqlens_q=bad, cu_seqlens_k=bad)


def test_a_sample_does_not_depend_on_its_pack(csrc_attention):
    q, k, v, cu_q, cu_k = _pack([7, 11, 4], [7, 11, 4], 4, 2, 64, seed=5)
    full = csrc_attention.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    alone = csrc_attention.attention(q[7:18].clone(), k[7:18].clone(), v[7:18].clone(), causal=True,
                                     cu_seqlens_q=torch.tensor([0, 11], dtype=torch.int32),
                                     cu_seqlens_k=torch.tensor([0, 11], dtype=torch.int32))
    assert torch.equal(full[7:18], alone)


def test_compiled_self_attention_traces_whole_with_changing_lengths(csrc_attention):
    """parallel.compile on the CPU: packed self-attention (one cu_seqlens tensor for queries and keys, the hint
    given as the decoder layers give it) traces into one graph (fullgraph) with the pack length dynamic, and
    equals eager. Before: the same tensor passed twice to the autograd.Function broke the graph in every layer,
    and the C++ fake kernels asked symbolic sizes for an int64 numel (a crash at the first dynamic shape)."""
    torch._dynamo.reset()

    def attend(q, k, v, cu, max_seqlen):
        return csrc_attention.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                        max_seqlen_k=max_seqlen)

    compiled = torch.compile(attend, backend="eager", fullgraph=True, dynamic=True)
    for lens in ([5, 9, 3], [7, 12]):
        q, k, v, cu, _ = _pack(lens, lens, 4, 2, 16, seed=len(lens))
        leaves_e = [t.clone().requires_grad_() for t in (q, k, v)]
        leaves_c = [t.clone().requires_grad_() for t in (q, k, v)]
        eager, out = attend(*leaves_e, cu, max(lens)), compiled(*leaves_c, cu, max(lens))
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        out.square().sum().backward()
        eager.square().sum().backward()
        for a, b in zip(leaves_c, leaves_e):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
