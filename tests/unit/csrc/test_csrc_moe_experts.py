"""The fused CPU experts op (csrc/cpu_moe_experts.cpp via kernels/csrc/moe_experts.py) against two references:

* a per-token transcription of the routed-experts equation, out[t] = sum_j w[t, j] * W2[e_j] act(W1[e_j] x[t])
  (act(h) = act(gate) * up for the gated [gate; up] layout), in float64;
* `GroupedExperts` on the pure-torch reference kernels (the "torch" backends) (moe_permute -> grouped_mm -> activation -> grouped_mm ->
  moe_unpermute), in float32.

Over random shapes: 1 to 8 experts, top-1 to top-3, experts without tokens, gated and not, every activation,
hidden / intermediate sizes that are not multiples of 8, no tokens at all; on MKL-packed weights and on the
plain ones. Bad input is refused."""
import pytest
import torch

from megatron_vlm.kernels import use_backends
from megatron_vlm.kernels.csrc import moe_experts as fused
from megatron_vlm.models.common.moe import GroupedExperts, activation_fn


@pytest.fixture(autouse=True)
def _needs_ext(ext):
    return ext


def _case(seed, n, e, k, hidden, inter, gated, used=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    experts = torch.arange(e) if used is None else torch.tensor(used)
    ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:k]] for _ in range(n)]) if n else \
        torch.zeros(0, k, dtype=torch.long)
    wts = torch.rand(n, k, generator=g)
    w1 = torch.randn(e, (2 if gated else 1) * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter ** 0.5
    return x, ids, wts, w1, w2


def _per_token(x, ids, wts, w1, w2, gated, activation):
    act = activation_fn(activation)
    x, w1, w2, wts = x.double(), w1.double(), w2.double(), wts.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e] @ x[t]
            mid = act(h[: h.shape[0] // 2]) * h[h.shape[0] // 2:] if gated else act(h)
            out[t] += wts[t, j] * (w2[e] @ mid)
    return out


def _module(x, ids, wts, w1, w2, gated, activation):
    mod = GroupedExperts(w1.shape[0], w1.shape[2], w2.shape[2], activation=activation, gated=gated)
    with torch.no_grad():
        (mod.gate_up_proj if gated else mod.up_proj).copy_(w1)
        mod.down_proj.copy_(w2)
    with use_backends({"moe_permute": "torch", "grouped_mm": "torch", "moe_unpermute": "torch"}), \
            torch.no_grad():
        return mod(x, ids, wts)


CASES = [  # seed, tokens, experts, top-k, hidden, intermediate, gated, activation, experts used (None = all)
    (0, 64, 8, 2, 256, 256, True, "silu", None),  # the tiny Qwen3-MoE rollout row's decode shape
    (1, 17, 8, 2, 36, 20, True, "silu", [0, 2, 3, 7]),  # half the experts get no token
    (2, 5, 3, 3, 20, 12, True, "silu", None),
    (3, 9, 1, 1, 33, 7, True, "silu", None),
    (4, 13, 6, 2, 24, 10, False, "relu2", [1, 4, 5]),  # Nemotron-H's non-gated relu^2 experts
    (5, 7, 4, 2, 12, 9, False, "gelu", None),
    (6, 11, 5, 3, 28, 6, True, "gelu_pytorch_tanh", None),
    (7, 1, 8, 2, 40, 16, False, "silu", None),
    (8, 0, 4, 2, 16, 8, True, "silu", None),  # no tokens
]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_fused_experts_equal_the_references(case, packed):
    seed, n, e, k, hidden, inter, gated, activation, used = case
    x, ids, wts, w1, w2 = _case(seed, n, e, k, hidden, inter, gated, used)
    p1 = fused.pack_expert_weights(w1) if packed else None
    p2 = fused.pack_expert_weights(w2) if packed else None
    if packed and p1.numel() == 0:
        pytest.skip("this torch has no MKL packed GEMM (the plain case covers the op)")
    with torch.inference_mode():
        out, counts = fused.moe_experts(x, ids, wts, w1, w2, gated=gated, activation=activation, w1_packed=p1,
                                        w2_packed=p2)
    assert out.dtype == torch.float32 and out.shape == (n, hidden)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=e))
    torch.testing.assert_close(out.double(), _per_token(x, ids, wts, w1, w2, gated, activation), rtol=1e-5, atol=2e-6)
    ref, ref_counts = _module(x, ids, wts, w1, w2, gated, activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    assert torch.equal(counts, ref_counts)


def test_bad_input_is_refused():
    x, ids, wts, w1, w2 = _case(10, 4, 3, 2, 16, 8, True)
    with pytest.raises(ValueError, match="expert id 3"):
        fused.moe_experts(x, torch.full_like(ids, 3), wts, w1, w2, gated=True, activation="silu")
    with pytest.raises(ValueError, match="activation"):
        fused.moe_experts(x, ids, wts, w1, w2, gated=True, activation="tanh")
    with pytest.raises(ValueError, match="w2"):
        fused.moe_experts(x, ids, wts, w1, w2[:, :8], gated=True, activation="silu")
    with pytest.raises(ValueError, match="hidden"):
        fused.moe_experts(x[:, :8], ids, wts, w1, w2, gated=True, activation="silu")
    p1 = fused.pack_expert_weights(w1)
    if p1.numel():  # a packed copy of another shape
        with pytest.raises(ValueError, match="packed"):
            fused.moe_experts(x, ids, wts, w1, w2, gated=True, activation="silu", w1_packed=p1[:2], w2_packed=None)
