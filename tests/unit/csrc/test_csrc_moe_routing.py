"""Compiled MoE routing (csrc backend of kernels.moe_permute / kernels.moe_topk_gating) vs the torch
reference: indices exactly, weights <= 1e-6, gradients, fake kernels (opcheck, torch.compile)."""
import pytest
import torch

from megatron_vlm import kernels
from megatron_vlm.kernels.csrc import moe as csrc_moe
from megatron_vlm.kernels.reference.moe import moe_permute as ref_permute
from megatron_vlm.kernels.reference.moe_routing import moe_topk_gating as ref_gating

GATING_CASES = [
    dict(score_func="softmax"),
    dict(score_func="softmax", norm_topk_prob=False),
    dict(score_func="sigmoid", bias=True, routed_scaling_factor=2.5),
    dict(score_func="sigmoid", bias=True, n_group=8, topk_group=4),  # Nemotron-H / DeepSeek-V3 grouped top-k
    dict(score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=False),
]


def _gating_inputs(case, n=513, e=64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g).to(device)
    kw = dict(case)
    if kw.pop("bias", False):
        kw["bias"] = (torch.randn(e, generator=g) * 0.05).to(device)
    return logits, kw


def _check_gating(got, want):
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", GATING_CASES)
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_topk_gating_cpu(ext, case, top_k):
    logits, kw = _gating_inputs(case)
    _check_gating(csrc_moe.moe_topk_gating(logits, top_k, **kw), ref_gating(logits, top_k, **kw))


def test_topk_gating_gradients(ext):
    for case in GATING_CASES:
        logits, kw = _gating_inputs(case, n=33, e=16, seed=1)
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got, want = csrc_moe.moe_topk_gating(a, 4, **kw), ref_gating(b, 4, **kw)
        g = torch.Generator().manual_seed(2)
        gs, gw = torch.randn(33, 16, generator=g), torch.randn(33, 4, generator=g)
        ((got[0] * gs).sum() + (got[1] * gw).sum()).backward()
        ((want[0] * gs).sum() + (want[1] * gw).sum()).backward()
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n,k,e", [(1, 1, 1), (300, 2, 8), (2048, 8, 128), (97, 4, 60), (0, 2, 4)])
def test_permute_cpu(ext, n, k, e):
    g = torch.Generator().manual_seed(n + k)
    hidden = torch.randn(n, 5, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]) if n else torch.zeros(0, k, dtype=torch.long)
    for topk_ids in (ids, ids.int()):
        got, want = csrc_moe.moe_permute(hidden, topk_ids, num_experts=e), ref_permute(hidden, topk_ids, num_experts=e)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    if n:  # skewed routing (hot experts, repeated ids) and the default num_experts
        skew = torch.randint(0, 3, (n, k), generator=g)
        for a, b in zip(csrc_moe.moe_permute(hidden, skew), ref_permute(hidden, skew)):
            assert torch.equal(a, b)


def test_permute_errors_match_reference(ext):
    hidden = torch.randn(3, 4)
    for ids, kw in ((torch.tensor([[0], [5], [1]]), dict(num_experts=4)), (torch.tensor([[0], [-1], [1]]), {}),
                    (torch.randn(3, 1), {}), (torch.zeros(2, 1, dtype=torch.long), {})):
        with pytest.raises(ValueError) as got:
            csrc_moe.moe_permute(hidden, ids, **kw)
        with pytest.raises(ValueError) as want:
            ref_permute(hidden, ids, **kw)
        assert str(got.value) == str(want.value)


def test_registry_selects_csrc_and_forcing_works(ext):
    logits, kw = _gating_inputs(GATING_CASES[2], n=20, e=16)
    # auto: csrc where it was measured faster (moe_permute on CPU and CUDA, the gating on CUDA only)
    assert kernels.DEFAULT_REGISTRY.choose("moe_topk_gating", "cpu", torch.float32) == "torch"
    assert kernels.DEFAULT_REGISTRY.choose("moe_permute", "cpu", torch.float32) == "csrc"
    want = kernels.moe_topk_gating(logits, 4, **kw)
    with kernels.use_backends({"moe_topk_gating": "csrc"}):
        assert kernels.DEFAULT_REGISTRY.choose("moe_topk_gating", "cpu", torch.float32) == "csrc"
        _check_gating(kernels.moe_topk_gating(logits, 4, **kw), want)


def test_opcheck(ext):
    logits, kw = _gating_inputs(GATING_CASES[3], n=17, e=32)
    torch.library.opcheck(torch.ops.megatron_vlm.topk_gating.default, (logits, kw["bias"], 4, True, 8, 4, True, 1.0))
    torch.library.opcheck(torch.ops.megatron_vlm.moe_permute_indices.default, (torch.randint(0, 6, (9, 2)), 6))
    torch.library.opcheck(torch.ops.megatron_vlm.first_fit_pack.default,
                          (torch.tensor([3, 5, 2, 7]), torch.tensor([3, 0, 1, 2]), 8, 64),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(ext):
    """The MoE routing path through the registry compiles with fullgraph=True (Meta kernels, autograd)."""
    torch._dynamo.reset()

    def route(x, w, bias):
        scores, weights, ids = kernels.moe_topk_gating(x @ w, 2, score_func="sigmoid", bias=bias, n_group=2,
                                                       topk_group=1)
        permuted, row_map, counts = kernels.moe_permute(x, ids, num_experts=8)
        return (permuted.sum(-1) * weights.reshape(-1)[row_map.long().argsort()]).sum() + scores.sum(), counts

    x, w, bias = torch.randn(12, 6), torch.randn(6, 8, requires_grad=True), torch.zeros(8)
    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    out, counts = compiled(x, w, bias)
    want, want_counts = route(x, w, bias)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, want_counts)
    out.backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_reference(ext):
    if not ext.load().with_cuda:
        pytest.fail("megatron_vlm._C was built without its CUDA sources on a machine with CUDA")
    for case in GATING_CASES:
        for top_k in (1, 8):
            logits, kw = _gating_inputs(case, n=8192, e=128, device="cuda")
            _check_gating(csrc_moe.moe_topk_gating(logits, top_k, **kw), ref_gating(logits, top_k, **kw))
    for n, k, e in ((8192, 8, 128), (5, 2, 4), (1000, 1, 1000), (3000, 6, 60)):
        ids = torch.rand(n, e, device="cuda").argsort(-1)[:, :k]
        hidden = torch.randn(n, 8, device="cuda")
        for a, b in zip(csrc_moe.moe_permute(hidden, ids, num_experts=e), ref_permute(hidden, ids, num_experts=e)):
            assert torch.equal(a, b)
