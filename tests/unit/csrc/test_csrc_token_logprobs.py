"""linear_token_logprobs on the csrc backend (C++ row algebra, kernels/csrc/token_logprobs.py) against the float64
reference (kernels/reference/token_logprobs.py): log-probs, entropy, gradients to hidden and weight (with and
without the entropy term, temperature, ignored labels, several chunks), and the reference's errors."""
import importlib

import pytest
import torch

from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

ref = importlib.import_module("megatron_vlm.kernels.reference.token_logprobs")


@pytest.fixture
def csrc_logprobs(ext):
    return importlib.import_module("megatron_vlm.kernels.csrc.token_logprobs")


@pytest.mark.parametrize("temperature,entropy,chunk", [(1.0, False, None), (1.0, True, 7), (0.7, True, 16), (1.3, False, 5)])
def test_matches_float64_reference(csrc_logprobs, temperature, entropy, chunk):
    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 37, 24, 101
    h, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[3, 20]] = ref.IGNORE_INDEX
    outs = {}
    for name, fn, dtype in (("csrc", csrc_logprobs.linear_token_logprobs, torch.float32),
                            ("ref", ref.linear_token_logprobs, torch.float64)):
        hl, wl = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        res = fn(hl, wl, labels, temperature=temperature, return_entropy=entropy, chunk_size=chunk)
        res = res if isinstance(res, tuple) else (res,)
        cot = [torch.randn(r.shape, generator=torch.Generator().manual_seed(1)).to(r.dtype) for r in res]
        outs[name] = (*res, *torch.autograd.grad(res, (hl, wl), cot))
    for a, b in zip(outs["csrc"], outs["ref"]):
        assert a.dtype == torch.float32
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 2e-6 * max(b.abs().max().item(), 1.0), err
    assert outs["csrc"][0][3] == 0 and outs["csrc"][0][20] == 0


def test_errors_and_dispatch(csrc_logprobs):
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="outside"):
        csrc_logprobs.linear_token_logprobs(h, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="temperature"):
        csrc_logprobs.linear_token_logprobs(h, w, torch.tensor([0, 1, 2, 3]), temperature=0.0)
    hb, wb = h.bfloat16(), w.bfloat16()  # other dtypes: the reference, bitwise
    labels = torch.tensor([0, 1, 2, 3])
    assert torch.equal(csrc_logprobs.linear_token_logprobs(hb, wb, labels), ref.linear_token_logprobs(hb, wb, labels))
    assert DEFAULT_REGISTRY.choose("linear_token_logprobs", "cpu", torch.float32) == "csrc"


@pytest.mark.parametrize("temperature,entropy", [(1.0, False), (0.7, True)])
def test_kept_logits_give_the_recomputed_gradients(csrc_logprobs, monkeypatch, temperature, entropy):
    """Small logits are kept for the backward (one GEMM less per chunk); the gradients are the recomputing
    backward's bit for bit, a second backward (retain_graph) recomputes, and no_grad keeps nothing."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(29, 16, generator=g), torch.randn(53, 16, generator=g)
    labels = torch.randint(0, 53, (29,), generator=g)
    cot = torch.randn(29, generator=g)
    calls = []
    real = csrc_logprobs._LinearTokenLogprobs.forward

    def spy(ctx, *args):
        out = real(ctx, *args)
        calls.append(ctx.kept)
        return out

    monkeypatch.setattr(csrc_logprobs._LinearTokenLogprobs, "forward", staticmethod(spy))

    def grads(retain: bool = False):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        res = csrc_logprobs.linear_token_logprobs(hl, wl, labels, temperature=temperature, return_entropy=entropy,
                                                  chunk_size=8)
        loss = ((res[0] if entropy else res) * cot).sum() + (res[1].sum() if entropy else 0.0)
        first = torch.autograd.grad(loss, (hl, wl), retain_graph=retain)
        return first, (torch.autograd.grad(loss, (hl, wl)) if retain else None)

    kept, again = grads(retain=True)
    assert calls[-1] is not None and len(calls[-1]) == 4  # 29 rows in chunks of 8
    monkeypatch.setattr(csrc_logprobs, "KEEP_LOGITS_BYTES", 0)
    recomputed, _ = grads()
    assert calls[-1] is None
    for a, b, c in zip(kept, recomputed, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    monkeypatch.setattr(csrc_logprobs, "KEEP_LOGITS_BYTES", 64 * 2**20)
    with torch.no_grad():
        csrc_logprobs.linear_token_logprobs(h.requires_grad_(), w, labels)
    assert calls[-1] is None
