"""RL log-probs of the distribution with the vision tokens removed (training/masked_vocab.py) against a plain
masked log_softmax over full logits (pure torch): values, entropies and gradients, every CPU backend of the fused
kernel, padded (ignored labels) and packed batches, with temperature; and the sampler's reported log-probs."""
import pytest
import torch

from megatron_vlm import _ext, kernels
from megatron_vlm.inference.sampling import sample_tokens
from megatron_vlm.rl.logprobs import response_token_logprobs
from megatron_vlm.training.masked_vocab import masked_token_logprobs

V, H = 41, 16
MASKED = (3, 17, 40)


def _plain(hidden, weight, labels, temperature, masked):
    """log q(label) and H(q) with q = softmax(z / T) restricted to the ids not in `masked` (the -inf fill)."""
    z = (hidden @ weight.T) / temperature
    if masked:
        z = z.index_fill(-1, torch.tensor(masked), float("-inf"))
    logq = torch.log_softmax(z, dim=-1)
    q = logq.exp()
    ent = -(q * logq.masked_fill(q == 0, 0.0)).sum(-1)
    valid = labels != -100
    lp = logq.gather(-1, torch.where(valid, labels, 0)[:, None]).squeeze(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _data(dtype, n=23, seed=0, boost=2.0):
    """Random hidden / LM head with the masked ids' rows scaled up: they carry real probability mass (up to ~80 %
    of a row at most: the correction divides by 1 - P, so its rounding error grows as P nears 1), as a policy whose
    vision logits drifted up does."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    weight[list(MASKED)] *= boost
    labels = torch.randint(0, V, (n,), generator=g)
    labels = torch.where(torch.isin(labels, torch.tensor(MASKED)), 5, labels)  # never a masked id (never sampled)
    labels[[2, 9, 10]] = -100  # padding / prompt rows
    return hidden.to(dtype), weight.to(dtype), labels


def _backends():
    out = ["torch"]
    if _ext.available():
        out.append("csrc")
    return out


@pytest.mark.parametrize("backend,dtype", [(b, d) for b in _backends() for d in (torch.float32, torch.float64)
                                           if not (b == "csrc" and d == torch.float64)])  # csrc: fp32 only
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("boost", [2.0, 6.0])  # 6: rows where the masked ids hold up to 99.9996 % (recomputed exactly)
def test_kernel_plus_correction_is_the_masked_softmax(backend, dtype, temperature, boost):
    hidden, weight, labels = _data(dtype, boost=boost)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with kernels.use_backends({"linear_token_logprobs": backend}):
        full, full_ent = kernels.linear_token_logprobs(h1, w1, labels, temperature=temperature, return_entropy=True)
    logp, ent = masked_token_logprobs(h1, w1, labels, full, full_ent, MASKED, temperature=temperature)
    # the reference in fp64 whatever the dtype: the error measured is ours, not the fp32 reference's
    h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref, ref_ent = _plain(h2, w2, labels, temperature, MASKED)
    tol = dict(rtol=5e-5, atol=5e-5)  # the kernels' outputs are fp32 whatever the input dtype (their contract)
    torch.testing.assert_close(logp.double(), ref, **tol)
    torch.testing.assert_close(ent.double(), ref_ent, **tol)
    # the vision ids carry real mass here: the full-softmax log-probs are far from the masked ones
    ref_full, _ = _plain(hidden.double(), weight.double(), labels, temperature, ())
    assert (ref_full - ref).abs().max() > 0.3
    wl, we = torch.linspace(-1, 2, len(ref), dtype=torch.float64), torch.linspace(1, -0.5, len(ref), dtype=torch.float64)
    ((logp.double() * wl).sum() + (ent.double() * we).sum()).backward()
    ((ref * wl).sum() + (ref_ent * we).sum()).backward()
    gt = dict(rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(h1.grad.double(), h2.grad, **gt)
    torch.testing.assert_close(w1.grad.double(), w2.grad, **gt)
    assert (logp[labels == -100] == 0).all()


def test_no_masked_ids_is_the_full_softmax_unchanged():
    hidden, weight, labels = _data(torch.float32)
    full, ent = kernels.linear_token_logprobs(hidden, weight, labels, temperature=0.7, return_entropy=True)
    logp, ent2 = masked_token_logprobs(hidden, weight, labels, full, ent, (), temperature=0.7)
    assert logp is full and ent2 is ent
    with pytest.raises(ValueError, match="outside the vocabulary"):
        masked_token_logprobs(hidden, weight, labels, full, ent, (V,))


def test_packed_response_logprobs_are_masked():
    """The packed GRPO layout (sequences concatenated, prompt tokens unlabelled): log q and H(q) of each response
    token from the hidden state before it, gradients included."""
    g = torch.Generator().manual_seed(1)
    cu, prompt = [0, 7, 12, 21], [3, 2, 4]
    n = cu[-1]
    ids = torch.randint(0, V, (n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    for s, p in enumerate(prompt):
        mask[cu[s] + p:cu[s + 1]] = True
    ids = torch.where(mask & torch.isin(ids, torch.tensor(MASKED)), 6, ids)
    hidden, weight, _ = _data(torch.float64, n=n, seed=2)
    h = hidden.clone().requires_grad_(True)
    logp, ent = response_token_logprobs(h, weight, ids, mask, cu_seqlens=torch.tensor(cu), temperature=0.8,
                                        return_entropy=True, masked_token_ids=MASKED)
    labels = torch.full((n,), -100)
    for s in range(3):
        for t in range(cu[s] + 1, cu[s + 1]):
            if mask[t]:
                labels[t - 1] = ids[t]
    h2 = hidden.clone().requires_grad_(True)
    ref_prev, ref_ent_prev = _plain(h2, weight, labels, 0.8, MASKED)
    ref = torch.cat([ref_prev.new_zeros(1), ref_prev[:-1]])
    ref_ent = torch.cat([ref_ent_prev.new_zeros(1), ref_ent_prev[:-1]])
    torch.testing.assert_close(logp.double(), ref, rtol=5e-5, atol=5e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=5e-5, atol=5e-5)
    (logp * torch.arange(n)).sum().backward()
    (ref * torch.arange(n)).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=5e-5)


def _masked_logp(logits, temperature, tokens):
    z = logits / (temperature or 1.0)
    return torch.log_softmax(z.index_fill(-1, torch.tensor(MASKED), float("-inf")), -1).gather(-1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("shift", [1.0, 30.0])  # 30: the suppressed ids hold all of the mass (P rounds to 1)
def test_sampler_reports_the_masked_distribution(fused, temperature, shift):
    """The built-in engine's behaviour log-prob is of the distribution it draws from (vision ids removed), on the
    C++ fused draw, the ATen draw and greedy alike."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=g)
    logits[:, list(MASKED)] += shift  # real mass on the suppressed ids
    uniform = torch.rand(64, generator=g)
    sup = torch.tensor(MASKED)
    if fused and not _ext.available():
        pytest.skip("the compiled extension is not built here")
    ctx = _ext.python_only() if not fused else torch.no_grad()
    with ctx:
        tokens, lp = sample_tokens(logits, temperature=temperature, suppress_token_ids=sup, uniform=uniform)
    assert not torch.isin(tokens, sup).any()
    torch.testing.assert_close(lp, _masked_logp(logits, temperature, tokens), rtol=1e-5, atol=1e-5)
    full = torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, tokens[:, None])[:, 0]
    assert (full - lp).abs().max() > 0.3  # the full softmax would be off
