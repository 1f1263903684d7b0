"""The fused CPU sampler (csrc/cpu_sampling.cpp `sample_rows`, taken by `inference.sampling.sample_tokens` for an
untruncated draw with given uniforms) against the torch path of the same function (`_ext.python_only()`), and
against the distribution itself: same tokens for the same uniforms, log-probs within float rounding, suppressed
and -inf tokens never drawn, the edges of [0, 1), bad input refused."""
import pytest
import torch

from megatron_vlm import _ext
from megatron_vlm.inference.sampling import sample_tokens


@pytest.fixture(autouse=True)
def _needs_ext(ext):
    return ext


def _assert_logprobs_close(lp, lp_ref, logits, tok, temperature, suppress=None):
    """The two paths' log-probs agree within float32 rounding, whatever CPU capability torch dispatches its kernels to.

    Why not a fixed atol: lp = x_tok / T - logsumexp(x / T) is computed in float32 by both paths, and torch sums the
    V exponentials with the vector width of the capability it picked (8 lanes with AVX2, 16 with AVX-512, scalar
    with "default"), so the rounding of the sum differs between machines: 2.9e-6 on AVX-512 for V = 8193, T = 0.7
    where AVX2 gives 1.9e-6. Per element the bound is a few ulps of the two terms (eps * 2 |x_tok / T| and
    eps * 2 |logsumexp|) plus the rounding error of a V-term float32 sum, which grows like eps * sqrt(V) (the
    random-walk bound of a recursive sum, Higham, "Accuracy and Stability of Numerical Algorithms", 4.2).
    Measured: at most 0.3 of this bound for V <= 8193 under default, AVX2 and AVX-512 (0.72 for V = 50000).
    With suppressed ids the reported log-prob is renormalised over the others, log p - log(1 - P) with P their
    probability (computed from log p): its error is log p's times d/d(log p) = 1 / (1 - P)."""
    scaled = logits.double() / temperature
    eps = torch.finfo(torch.float32).eps
    tol = eps * (2 * scaled.gather(1, tok[:, None]).squeeze(1).abs() + 2 * torch.logsumexp(scaled, -1).abs()
                 + logits.shape[-1] ** 0.5)
    if suppress is not None:
        tol = tol / (1 - torch.softmax(scaled, -1)[:, suppress].sum(-1))
    diff = (lp.double() - lp_ref.double()).abs()
    finite = torch.isfinite(lp_ref)
    assert torch.equal(finite, torch.isfinite(lp)) and torch.equal(lp[~finite], lp_ref[~finite])
    assert bool((diff[finite] <= tol[finite]).all()), (diff / tol).max().item()


def _both(logits, uniform, **kw):
    fused = sample_tokens(logits, uniform=uniform, **kw)
    with _ext.python_only():
        ref = sample_tokens(logits, uniform=uniform, **kw)
    return fused, ref


@pytest.mark.parametrize("vocab, suppress", [(1, False), (7, False), (7, True), (1024, False), (1024, True),
                                             (8193, False), (8193, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_equals_the_torch_path(vocab, temperature, suppress):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 3
    uniform = torch.rand(64, generator=g)
    ids = torch.tensor([0, vocab // 2, vocab - 1]).unique() if suppress else None
    (tok, lp), (tok_ref, lp_ref) = _both(logits, uniform, temperature=temperature, suppress_token_ids=ids)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, tok_ref)
    _assert_logprobs_close(lp, lp_ref, logits, tok, temperature, ids)
    if ids is not None:
        assert not torch.isin(tok, ids).any()


def test_edges_of_the_unit_interval_and_minus_inf_logits():
    logits = torch.full((4, 50), float("-inf"))
    logits[:, [3, 17, 40]] = torch.tensor([0.5, -1.0, 2.0])
    uniform = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5, 0.999])
    (tok, lp), (tok_ref, lp_ref) = _both(logits, uniform, temperature=1.0)
    assert torch.equal(tok, tok_ref)
    assert tok[0] == 3 and tok[1] == 40  # the first / last token with mass
    assert set(tok.tolist()) <= {3, 17, 40}
    _assert_logprobs_close(lp, lp_ref, logits, tok, 1.0)
    # the last token with mass suppressed: u near 1 picks the one before it
    tok, _ = sample_tokens(logits, uniform=uniform, temperature=1.0, suppress_token_ids=torch.tensor([40]))
    assert tok[1] == 17 and 40 not in tok.tolist()


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    n = 40000
    logits = probs.log().expand(n, -1).contiguous() * 1.0
    tok, lp = sample_tokens(logits, uniform=torch.rand(n, generator=torch.Generator().manual_seed(0)), temperature=1.0)
    freq = torch.bincount(tok, minlength=5).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() < 5 * sigma).all(), freq
    torch.testing.assert_close(lp, probs.log()[tok], rtol=0, atol=2e-6)


def test_bad_input():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match="uniform"):
        sample_tokens(logits, uniform=torch.rand(2), temperature=1.0)
    with pytest.raises(ValueError, match="suppressed"):
        sample_tokens(logits, uniform=torch.rand(3), temperature=1.0, suppress_token_ids=torch.arange(5))
    with pytest.raises(ValueError, match="outside"):
        sample_tokens(logits, uniform=torch.rand(3), temperature=1.0, suppress_token_ids=torch.tensor([7]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_a_row_without_a_distribution_is_an_error(bad):
    """A NaN / +inf logit, or a row of -inf only (a model that overflowed), has no distribution to sample: the
    fused op raises naming the row instead of returning a token with a NaN log-prob (silently, into the rollout)."""
    logits = torch.randn(3, 20)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 7] = bad
    with pytest.raises(ValueError, match="row 1"):
        torch.ops.megatron_vlm.sample_rows(logits, torch.rand(3), None, 1.0)


def test_non_contiguous_rows_and_truncation_keep_their_paths():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(8, 3, 100, generator=g)
    last = full[:, -1]  # what the engine passes: a strided view
    uniform = torch.rand(8, generator=g)
    (tok, lp), (tok_ref, lp_ref) = _both(last, uniform, temperature=1.0)
    assert torch.equal(tok, tok_ref)
    # top-k / top-p draws stay on the torch path: bitwise the python_only result
    (tok, lp), (tok_ref, lp_ref) = _both(last, uniform, temperature=1.0, top_k=5, top_p=0.9)
    assert torch.equal(tok, tok_ref) and torch.equal(lp, lp_ref)
