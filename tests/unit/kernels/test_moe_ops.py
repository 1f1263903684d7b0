"""MoE dispatch ops (moe_permute, grouped_mm, moe_unpermute) against loops, and the NPU adapters
against an emulator of torch_npu's documented semantics."""
import npu_moe_emulator
import pytest
import torch

from megatron_vlm.kernels.npu import moe as npu_moe
from megatron_vlm.kernels.reference.moe import grouped_mm, moe_permute, moe_unpermute


def routing(seed, n=13, k=3, e=6, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    if skip_expert is not None:  # an expert nobody picks (empty group)
        ids[ids == skip_expert] = (skip_expert + 1) % e
    return ids


@pytest.mark.parametrize("n,k,e", [(1, 1, 4), (7, 2, 5), (13, 3, 6)])
def test_moe_permute_matches_loop(n, k, e):
    ids = routing(n, n, k, e)
    hidden = torch.randn(n, 4)
    permuted, row_map, counts = moe_permute(hidden, ids, num_experts=e)
    # loop: for each expert in order, the (token, slot) pairs that chose it, in flat order
    expected_rows, expected_pairs = [], []
    for ex in range(e):
        for t in range(n):
            for j in range(k):
                if ids[t, j] == ex:
                    expected_rows.append(hidden[t])
                    expected_pairs.append(t * k + j)
    torch.testing.assert_close(permuted, torch.stack(expected_rows))
    assert row_map.dtype == torch.int32
    for r, pair in enumerate(expected_pairs):
        assert int(row_map[pair]) == r
    assert counts.tolist() == [int((ids == ex).sum()) for ex in range(e)]


def test_moe_permute_errors():
    with pytest.raises(ValueError, match="num_experts"):
        moe_permute(torch.randn(2, 3), torch.tensor([[0], [4]]), num_experts=4)
    with pytest.raises(ValueError, match=r"\[N=2, k\]"):
        moe_permute(torch.randn(2, 3), torch.tensor([[0], [1], [2]]))


def grouped_loop(x, weight, counts, layout):
    out = torch.zeros(x.shape[0], weight.shape[2] if layout == "ekn" else weight.shape[1], dtype=x.dtype)
    start = 0
    for e, c in enumerate(counts):
        for r in range(start, start + c):
            w = weight[e] if layout == "ekn" else weight[e].t()
            out[r] = x[r] @ w
        start += c
    return out


@pytest.mark.parametrize("layout", ["ekn", "enk"])
def test_grouped_mm_matches_loop_counts_and_offsets(layout):
    counts = [3, 0, 5, 1]  # an empty expert in the middle
    x = torch.randn(11, 6, dtype=torch.float64)  # 2 trailing padding rows
    weight = torch.randn(4, 6, 7, dtype=torch.float64) if layout == "ekn" else torch.randn(4, 7, 6, dtype=torch.float64)
    ref = grouped_loop(x, weight, counts, layout)
    out = grouped_mm(x, weight, tokens_per_expert=torch.tensor(counts), weight_layout=layout)
    torch.testing.assert_close(out, ref)
    out2 = grouped_mm(x, weight, offsets=torch.tensor(counts).cumsum(0).to(torch.int32), weight_layout=layout)
    torch.testing.assert_close(out2, ref)
    assert out[9:].abs().max() == 0


def test_grouped_mm_grads_match_loop():
    counts = [2, 4, 1]
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    go = torch.randn(7, 4, dtype=torch.float64)
    got = torch.autograd.grad((grouped_mm(x, w, tokens_per_expert=torch.tensor(counts), weight_layout="enk") * go).sum(), (x, w))
    ref = torch.autograd.grad((grouped_loop(x, w, counts, "enk") * go).sum(), (x, w))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("rows", [0, 3])
def test_grouped_mm_without_routed_rows_keeps_the_graph(rows):
    """An expert-parallel rank whose experts receive no token (all counts 0, only padding rows or none) still gets
    zero gradients for x and the weights, as from the Triton kernel, not None: an output cut from the graph leaves
    the experts' parameters without a gradient on that rank only (unlike its peers' in the same collective)."""
    x = torch.randn(rows, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    out = grouped_mm(x, w, tokens_per_expert=torch.zeros(3, dtype=torch.long), weight_layout="enk")
    assert out.shape == (rows, 4) and out.requires_grad
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert gx.shape == x.shape and not gx.any() and gw.shape == w.shape and not gw.any()


def test_grouped_mm_errors():
    with pytest.raises(ValueError, match="exactly one"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="2 experts"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 4, 5), tokens_per_expert=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="cover 5 rows"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 4, 5), tokens_per_expert=torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="K=4"):
        grouped_mm(torch.randn(3, 4), torch.randn(2, 4, 5), tokens_per_expert=torch.tensor([1, 2]), weight_layout="enk")


def test_unpermute_matches_loop_and_round_trip():
    n, k, e = 9, 2, 5
    ids = routing(3, n, k, e)
    hidden = torch.randn(n, 4, dtype=torch.float64)
    weights = torch.rand(n, k, dtype=torch.float64)
    permuted, row_map, _ = moe_permute(hidden, ids, num_experts=e)
    # an "expert" that scales its rows by (expert id + 1), so outputs depend on the routing
    scale = torch.repeat_interleave(torch.arange(1, e + 1, dtype=torch.float64), torch.bincount(ids.flatten(), minlength=e))
    out = moe_unpermute(permuted * scale[:, None], row_map, weights)
    ref = torch.zeros_like(hidden)
    for t in range(n):
        for j in range(k):
            ref[t] += weights[t, j] * (ids[t, j] + 1) * hidden[t]
    torch.testing.assert_close(out, ref)
    # without weights and k = 1 the round trip is the identity
    p1, m1, _ = moe_permute(hidden, ids[:, :1], num_experts=e)
    torch.testing.assert_close(moe_unpermute(p1, m1), hidden)


def test_full_moe_pipeline_matches_per_token_experts():
    """permute -> grouped up-proj -> relu^2 -> grouped down-proj -> unpermute == per-token expert loop."""
    n, k, e, h, f = 10, 2, 4, 6, 8
    ids = routing(4, n, k, e, skip_expert=2)
    x = torch.randn(n, h, dtype=torch.float64)
    w = torch.softmax(torch.randn(n, k, dtype=torch.float64), -1)
    up = torch.randn(e, f, h, dtype=torch.float64)
    down = torch.randn(e, h, f, dtype=torch.float64)
    permuted, row_map, counts = moe_permute(x, ids, num_experts=e)
    mid = torch.relu(grouped_mm(permuted, up, tokens_per_expert=counts, weight_layout="enk")) ** 2
    out = moe_unpermute(grouped_mm(mid, down, tokens_per_expert=counts, weight_layout="enk"), row_map, w)
    ref = torch.zeros_like(x)
    for t in range(n):
        for j in range(k):
            ex = ids[t, j]
            ref[t] += w[t, j] * (down[ex] @ (torch.relu(up[ex] @ x[t]) ** 2))
    torch.testing.assert_close(out, ref)


# ----------------------------------------------------------------------------- NPU adapters


def test_emulator_follows_documented_example():
    """The MindSpeed doc example: indices [[0,4],[4,3],[4,2],[1,1]] sort to sortedIndicesFirst
    [0,6,7,5,3,1,2,4]; torch_npu returns its inverse permutation."""
    indices = torch.tensor([[0, 4], [4, 3], [4, 2], [1, 1]])
    tokens = torch.arange(4, dtype=torch.float32)[:, None].expand(4, 3).contiguous()
    permuted, sorted_indices = npu_moe_emulator.npu_moe_token_permute(tokens, indices)
    first = torch.tensor([0, 6, 7, 5, 3, 1, 2, 4])
    assert torch.equal(sorted_indices[first].long(), torch.arange(8))
    assert permuted[:, 0].tolist() == [0, 3, 3, 2, 1, 0, 1, 2]


def test_npu_adapters_match_reference(monkeypatch):
    npu_moe_emulator.install(monkeypatch)
    n, k, e, h, f = 11, 2, 5, 4, 6
    ids = routing(5, n, k, e, skip_expert=1)
    x = torch.randn(n, h)
    w = torch.rand(n, k)
    ref_p, ref_map, ref_counts = moe_permute(x, ids, num_experts=e)
    p, m, c = npu_moe.moe_permute(x, ids, num_experts=e)
    torch.testing.assert_close(p, ref_p)
    assert torch.equal(m, ref_map) and torch.equal(c, ref_counts)
    for layout, weight in (("ekn", torch.randn(e, h, f)), ("enk", torch.randn(e, f, h))):
        ref = grouped_mm(p, weight, tokens_per_expert=c, weight_layout=layout)
        torch.testing.assert_close(npu_moe.grouped_mm(p, weight, tokens_per_expert=c, weight_layout=layout), ref)
        torch.testing.assert_close(npu_moe.grouped_mm(p, weight, offsets=c.cumsum(0), weight_layout=layout), ref)
    out = torch.randn(n * k, h)
    torch.testing.assert_close(npu_moe.moe_unpermute(out, m, w), moe_unpermute(out, m, w))
    p1, m1, _ = npu_moe.moe_permute(x, ids[:, 0], num_experts=e)
    torch.testing.assert_close(npu_moe.moe_unpermute(p1, m1), x)


@pytest.mark.parametrize("layout", ["ekn", "enk"])
@pytest.mark.parametrize("by", ["tokens_per_expert", "offsets"])
def test_npu_grouped_mm_trains(monkeypatch, layout, by):
    """npu_grouped_matmul has no derivative (torch's fallback warns and leaves its inputs without gradient), so
    the experts of an NPU MoE training step got no gradient; the adapter's own backward matches the reference,
    including rows past the last group (zero gradient) and an expert without rows."""
    npu_moe_emulator.install(monkeypatch)
    e, h, f = 4, 5, 6
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(11, h, requires_grad=True)  # 9 routed rows, 2 past the last group
    weight = torch.randn(*((e, h, f) if layout == "ekn" else (e, f, h)), requires_grad=True)
    groups = {"tokens_per_expert": counts} if by == "tokens_per_expert" else {"offsets": counts.cumsum(0)}
    out = npu_moe.grouped_mm(x, weight, weight_layout=layout, **groups)
    ref = grouped_mm(x, weight, weight_layout=layout, **groups)
    torch.testing.assert_close(out[:9], ref[:9])
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, weight), g), torch.autograd.grad(ref, (x, weight), g)):
        torch.testing.assert_close(a, b)
