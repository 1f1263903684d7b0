"""Triton MoE kernels (compiled on CUDA, interpreted on CPU) against the torch reference: grouped_mm forward and
gradients (x and weight) in both weight layouts, with empty experts, a single expert, padding rows
past the last group and sizes that are not multiples of the 16-wide interpreter tiles;
moe_unpermute forward and gradients (permuted rows and topk_weights); bad input; the MoE block with
the triton backend selected equals the torch backend and transformers' Qwen3-VL-MoE block.

The references (kernels/reference/moe.py) were checked against per-row loops in test_moe_ops.py.
Both sides accumulate in fp32, so fp32 tolerances are a few ulps. bf16 at larger shapes is checked
on CUDA only (`gpu` marker: the interpreter is too slow for them), plus one small grouped_mm case
that on CPU guards the interpreter bf16-dot workaround.
"""
import pytest
import torch
from kernel_checks import DEVICE

import megatron_vlm.kernels as K
from megatron_vlm.kernels.reference import moe as reference
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY
from megatron_vlm.kernels.triton import moe as t_moe

FP32 = dict(atol=2e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=2e-2)


def _ints(values):
    return torch.tensor(values, device=DEVICE)


def _weight(layout, experts, k, n, gen, dtype=torch.float32, device=DEVICE):
    shape = (experts, k, n) if layout == "ekn" else (experts, n, k)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _compare_grouped_mm(x, w, layout, tol, **groups):
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    ws = [w.detach().clone().requires_grad_() for _ in range(2)]
    got = t_moe.grouped_mm(xs[0], ws[0], weight_layout=layout, **groups)
    ref = reference.grouped_mm(xs[1], ws[1], weight_layout=layout, **groups)
    assert got.dtype == ref.dtype == x.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)).to(ref)
    g_dx, g_dw = torch.autograd.grad(got, (xs[0], ws[0]), upstream)
    r_dx, r_dw = torch.autograd.grad(ref, (xs[1], ws[1]), upstream)
    assert g_dw.shape == w.shape and g_dw.dtype == w.dtype
    torch.testing.assert_close(g_dx.float(), r_dx.float(), **tol, msg=lambda m: f"dx: {m}")
    torch.testing.assert_close(g_dw.float(), r_dw.float(), **tol, msg=lambda m: f"dweight: {m}")
    return got, g_dw


@pytest.mark.parametrize("layout", ["ekn", "enk"])
@pytest.mark.parametrize(
    "counts,k,n",
    [
        ([5, 0, 20, 12], 19, 23),  # an empty expert, groups not multiples of the 16-row tile
        ([37], 40, 9),  # a single expert; K spans three K-tiles
        ([0, 1, 0, 17, 0], 16, 33),  # mostly empty experts, one row group
    ],
)
def test_grouped_mm_counts_fp32(layout, counts, k, n):
    gen = torch.Generator().manual_seed(sum(counts) + k)
    x = torch.randn(sum(counts), k, generator=gen).to(DEVICE)
    w = _weight(layout, len(counts), k, n, gen)
    _, dw = _compare_grouped_mm(x, w, layout, FP32, tokens_per_expert=_ints(counts))
    for e, c in enumerate(counts):
        if c == 0:
            assert dw[e].abs().max() == 0, f"expert {e} has no rows but a non-zero weight gradient"


@pytest.mark.parametrize("layout", ["ekn", "enk"])
def test_grouped_mm_offsets_with_padding_rows(layout):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 30, generator=gen).to(DEVICE).t()  # non-contiguous; rows 26..29 are padding past the last group
    w = _weight(layout, 3, 12, 20, gen)
    got, _ = _compare_grouped_mm(x, w, layout, FP32, offsets=_ints([3, 3, 26]))
    assert got[26:].abs().max() == 0


def test_grouped_mm_all_groups_empty_and_no_rows():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2, 8, 5, generator=gen).to(DEVICE).requires_grad_()
    x = torch.randn(3, 8, generator=gen).to(DEVICE).requires_grad_()
    y = t_moe.grouped_mm(x, w, tokens_per_expert=_ints([0, 0]))
    assert y.shape == (3, 5) and y.abs().max() == 0
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert dx.abs().max() == 0 and dw.abs().max() == 0
    empty = t_moe.grouped_mm(torch.zeros(0, 8, device=DEVICE), w.detach(), tokens_per_expert=_ints([0, 0]))
    assert empty.shape == (0, 5)


def test_grouped_mm_errors_match_reference():
    x, w = torch.randn(6, 4, device=DEVICE), torch.randn(2, 4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="weight_layout"):
        t_moe.grouped_mm(x, w, tokens_per_expert=_ints([3, 3]), weight_layout="kn")
    with pytest.raises(ValueError, match="groups cover 9 rows but x has 6"):
        t_moe.grouped_mm(x, w, tokens_per_expert=_ints([4, 5]))
    with pytest.raises(ValueError, match="3 groups given for a weight with 2 experts"):
        t_moe.grouped_mm(x, w, tokens_per_expert=_ints([1, 2, 3]))
    with pytest.raises(ValueError, match="x has K=4 but weight"):
        t_moe.grouped_mm(x, w, tokens_per_expert=_ints([3, 3]), weight_layout="enk")
    with pytest.raises(ValueError, match="dtype"):
        t_moe.grouped_mm(x, w.double(), tokens_per_expert=_ints([3, 3]))


def _permuted(n_tokens, topk, hidden, gen, dtype=torch.float32, device=DEVICE):
    ids = torch.stack([torch.randperm(6, generator=gen)[:topk] for _ in range(n_tokens)])
    hidden_states = torch.randn(n_tokens, hidden, generator=gen)
    permuted, row_map, _ = reference.moe_permute(hidden_states, ids, num_experts=6)
    permuted = permuted + torch.randn(permuted.shape, generator=gen)  # stand-in for expert outputs
    return permuted.to(device=device, dtype=dtype), row_map.to(device)


def _compare_unpermute(permuted, row_map, weights, tol, topk=None):
    ps = [permuted.detach().clone().requires_grad_() for _ in range(2)]
    ws = [None if weights is None else weights.detach().clone().requires_grad_() for _ in range(2)]
    got = t_moe.moe_unpermute(ps[0], row_map, ws[0], topk=topk)
    ref = reference.moe_unpermute(ps[1], row_map, ws[1], topk=topk)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).to(ref)
    leaves = [0] if weights is None else [0, 1]
    g = torch.autograd.grad(got, [(ps[0], ws[0])[i] for i in leaves], upstream)
    r = torch.autograd.grad(ref, [(ps[1], ws[1])[i] for i in leaves], upstream)
    for name, a, b in zip(("d permuted", "d topk_weights"), g, r):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n_tokens,topk,hidden", [(1, 1, 8), (7, 3, 40), (13, 2, 1100)])
def test_moe_unpermute_weighted_fp32(n_tokens, topk, hidden):
    gen = torch.Generator().manual_seed(n_tokens * 10 + topk)
    permuted, row_map = _permuted(n_tokens, topk, hidden, gen)
    weights = torch.rand(n_tokens, topk, generator=gen).to(DEVICE)
    _compare_unpermute(permuted, row_map, weights, FP32)


def test_moe_unpermute_unweighted_sum():
    gen = torch.Generator().manual_seed(11)
    permuted, row_map = _permuted(5, 2, 24, gen)
    _compare_unpermute(permuted, row_map, None, FP32, topk=2)


def test_moe_unpermute_rejects_non_permutation_row_map():
    permuted = torch.randn(4, 8, device=DEVICE)
    rows = torch.arange(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="permutation of 0..3"):
        t_moe.moe_unpermute(permuted, torch.tensor([0, 1, 1, 3], dtype=torch.int32, device=DEVICE), torch.rand(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="topk_weights must be"):
        t_moe.moe_unpermute(permuted, rows, torch.rand(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="topk=3"):
        t_moe.moe_unpermute(permuted, rows, topk=3)


def test_grouped_mm_bf16_small():
    """bf16, small: on CPU through the interpreter's dot workaround (it multiplies bf16 operands as
    raw bits unless upcast); one rounding of an fp32 sum on both sides."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(41, 24, generator=gen).to(DEVICE, torch.bfloat16)
    w = (_weight("enk", 3, 24, 20, gen) / 5).bfloat16()
    _compare_grouped_mm(x, w, "enk", BF16, tokens_per_expert=_ints([17, 0, 24]))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["ekn", "enk"])
def test_grouped_mm_bf16_cuda(layout):
    gen = torch.Generator().manual_seed(5)
    counts = [0, 70, 3, 200, 1]
    x = torch.randn(sum(counts), 96, generator=gen).to("cuda", torch.bfloat16)
    w = (_weight(layout, len(counts), 96, 136, gen) / 10).to("cuda", torch.bfloat16)
    _compare_grouped_mm(x, w, layout, BF16, tokens_per_expert=torch.tensor(counts, device="cuda"))


@pytest.mark.gpu
def test_moe_unpermute_bf16_cuda():
    gen = torch.Generator().manual_seed(6)
    permuted, row_map = _permuted(33, 4, 200, gen, dtype=torch.bfloat16, device="cuda")
    _compare_unpermute(permuted, row_map, torch.rand(33, 4, generator=gen).cuda(), BF16)


def test_registry_auto_takes_triton_on_cuda_only(monkeypatch):
    """auto: Triton on CUDA, the reference on the CPU; grouped_mm in bf16 on sm90+ goes to torch._grouped_mm
    (measured faster there, kernels/torch_fused/grouped_mm.py), on older GPUs or other dtypes to Triton."""
    for capability, bf16_grouped in (((9, 0), "torch_grouped_mm"), ((8, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        DEFAULT_REGISTRY.clear_cache()
        try:
            assert DEFAULT_REGISTRY.choose("grouped_mm", "cuda", torch.bfloat16) == bf16_grouped
            assert DEFAULT_REGISTRY.choose("grouped_mm", "cuda", torch.float32) == "triton"
            assert DEFAULT_REGISTRY.choose("moe_unpermute", "cuda", torch.bfloat16) == "triton"
            for op in ("grouped_mm", "moe_unpermute"):
                assert DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) == "torch"
        finally:
            DEFAULT_REGISTRY.clear_cache()


def _qwen3_vl_moe_pair(seed):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    from megatron_vlm.models.common.moe import MoE

    cfg = Qwen3VLMoeTextConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, hidden_act="silu")
    torch.manual_seed(seed)
    hf = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    ours = MoE(16, num_experts=6, top_k=2, moe_intermediate_size=20, activation="silu", gated_experts=True,
               score_func="softmax", norm_topk_prob=True, score_correction_bias=False).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def test_moe_block_triton_backend_equals_torch_backend_and_transformers():
    hf, ours = (m.to(DEVICE) for m in _qwen3_vl_moe_pair(seed=2))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    upstream = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        with K.use_backends({"grouped_mm": backend, "moe_unpermute": backend}):
            assert DEFAULT_REGISTRY.choose("grouped_mm", DEVICE, torch.float32) == backend
            xi = x.clone().requires_grad_()
            out = ours(xi)
            grads = torch.autograd.grad(out, [xi, ours.experts.gate_up_proj, ours.experts.down_proj, ours.gate.weight], upstream)
        results[backend] = (out.detach(), grads)
    with torch.no_grad():
        torch.testing.assert_close(results["triton"][0], hf(x), **FP32)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **FP32)
    for name, a, b in zip(("x", "gate_up_proj", "down_proj", "router"), results["triton"][1], results["torch"][1]):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m: f"grad of {name}: {m}")
