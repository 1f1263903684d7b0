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
