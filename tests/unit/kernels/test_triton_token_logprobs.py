"""Triton chunked token log-probs / entropy (compiled on CUDA, interpreted on CPU) against the naive full-logits path
(hidden @ W^T, log_softmax) in fp64: values and gradients w.r.t. hidden and weight, ignore_index,
chunk boundaries, temperature; bf16 passes when within 2x the naive bf16 path's error."""
import pytest
import torch
from kernel_checks import DEVICE, assert_within_2x

from megatron_vlm.kernels.triton import token_logprobs as t_logprobs


def naive(hidden, weight, labels, temperature, logits_dtype=None):
    """Full [N, V] logits (optionally rounded to logits_dtype, as a bf16 lm_head produces), log_softmax."""
    logits = hidden @ weight.t()
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    valid = labels != -100
    lp = torch.where(valid, logp_all.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return lp, ent


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[-1] = v - 1
    labels[:-1:3] = -100
    return hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE)


@pytest.mark.parametrize("n,chunk_size", [(1, None), (7, 3), (20, 7)])
def test_token_logprobs_fp32_matches_naive(n, chunk_size):
    hidden, weight, labels = _inputs(n, 16, 1100, torch.float32)  # V not a multiple of the block
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = t_logprobs.linear_token_logprobs(h, w, labels, temperature=0.7, return_entropy=True, chunk_size=chunk_size)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (n,)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    exp_lp, exp_ent = naive(h64, w64, labels, 0.7)
    torch.testing.assert_close(lp.double(), exp_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), exp_ent, atol=2e-5, rtol=1e-5)
    assert (lp[labels == -100] == 0).all() and (ent[labels == -100] == 0).all()
    a, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    got = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), (h, w))
    exp = torch.autograd.grad((exp_lp * a.double()).sum() + (exp_ent * b.double()).sum(), (h64, w64))
    for name, g, e in zip(("hidden", "weight"), got, exp):
        torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-4, msg=lambda m: f"grad {name}: {m}")


def test_token_logprobs_without_entropy_and_ignored_rows_get_no_gradient():
    hidden, weight, labels = _inputs(6, 16, 300, torch.float32, seed=1)
    h = hidden.clone().requires_grad_()
    lp = t_logprobs.linear_token_logprobs(h, weight, labels)
    (gh,) = torch.autograd.grad(lp.sum(), (h,))
    assert (gh[labels == -100] == 0).all()
    exp_lp, _ = naive(hidden.double(), weight.double(), labels, 1.0)
    torch.testing.assert_close(lp.double(), exp_lp, atol=2e-5, rtol=1e-5)


def test_token_logprobs_bf16_within_2x_of_naive_bf16():
    hidden, weight, labels = _inputs(9, 32, 700, torch.bfloat16, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = t_logprobs.linear_token_logprobs(h, w, labels, return_entropy=True, chunk_size=4)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    exact_lp, exact_ent = naive(h64, w64, labels, 1.0)
    hb, wb = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    naive_lp, naive_ent = naive(hb, wb, labels, 1.0, logits_dtype=torch.bfloat16)
    assert_within_2x("logp", lp, exact_lp, naive_lp, 1e-3)
    assert_within_2x("entropy", ent, exact_ent, naive_ent, 1e-3)
    a = torch.randn(9, device=DEVICE)
    got = torch.autograd.grad((lp * a).sum() + ent.sum(), (h, w))
    exact = torch.autograd.grad((exact_lp * a.double()).sum() + exact_ent.sum(), (h64, w64))
    lowp = torch.autograd.grad((naive_lp * a.double()).sum() + naive_ent.sum(), (hb, wb))
    for name, g, e, lp in zip(("d_hidden", "d_weight"), got, exact, lowp):
        assert_within_2x(name, g, e, lp, 1e-2)


def test_token_logprobs_rejects_out_of_range_label():
    hidden, weight, _ = _inputs(2, 16, 50, torch.float32)
    with pytest.raises(ValueError, match="label -3 outside"):
        t_logprobs.linear_token_logprobs(hidden, weight, torch.tensor([1, -3], device=DEVICE))
