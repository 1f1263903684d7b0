"""Next-token sampling: top-k / top-p supports against a per-row Python reference, empirical
frequencies against the renormalised distribution, greedy, behaviour log-probs of the untruncated
temperature-scaled distribution, stop-string and EOS checks."""
import math

import pytest
import torch

from megatron_vlm import _ext
from megatron_vlm.inference.sampling import filter_logits, sample_tokens
from megatron_vlm.inference.stopping import StopChecker, eos_token_ids_of


def reference_support(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """Kept tokens, computed the textbook way: rank by probability, keep the first k, then keep
    tokens while the mass of the tokens ranked before them (renormalised over the k) is < top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        order = order[:top_k]
    z = sum(math.exp(logits[i]) for i in order)
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p and kept:
            break
        kept.add(i)
        mass += math.exp(logits[i]) / z
    return kept


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8), (3, 0.05), (64, 1.0)])
def test_filter_logits_support(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(6, 40, generator=g) * 2
    out = filter_logits(logits, top_k=top_k, top_p=top_p)
    for r in range(6):
        kept = {i for i in range(40) if torch.isfinite(out[r, i])}
        assert kept == reference_support(logits[r].tolist(), top_k, top_p), r
        assert torch.equal(out[r, sorted(kept)], logits[r, sorted(kept)])  # kept values untouched


def test_sampling_frequencies_follow_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    temperature, top_p = 0.8, 0.85
    n = 20000
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_tokens(logits.expand(n, -1), temperature=temperature, top_p=top_p, generator=gen)
    scaled = logits[0] / temperature
    kept = sorted(reference_support(scaled.tolist(), 0, top_p))
    probs = torch.zeros(6)
    probs[kept] = torch.softmax(scaled[kept], -1)
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert set(torch.unique(tokens).tolist()) <= set(kept)
    assert (freq - probs).abs().max() < 0.02  # ~4 standard errors at n = 20000
    # behaviour log-probs: the untruncated temperature-scaled distribution
    torch.testing.assert_close(logp, torch.log_softmax(scaled, -1)[tokens])


def test_greedy_and_top_k_one():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=g)
    tok, logp = sample_tokens(logits, temperature=0.0)
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
    tok1, logp1 = sample_tokens(logits, temperature=2.0, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tok1, tok)
    torch.testing.assert_close(logp1, torch.log_softmax(logits / 2.0, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="expected \\[N, vocab\\]"):
        sample_tokens(torch.zeros(3), temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_tokens(torch.zeros(1, 3), temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(torch.zeros(1, 3), top_p=1.5)


SAMPLING_PATHS = [  # greedy, multinomial, inverse CDF (untruncated, truncated), multinomial truncated
    dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, uniform=torch.full((3,), 0.5)),
    dict(temperature=1.0, top_k=5, uniform=torch.full((3,), 0.5)), dict(temperature=1.0, top_p=0.9),
]


@pytest.mark.parametrize("kw", SAMPLING_PATHS)
@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf", "all -inf but suppressed"])
def test_a_row_without_a_distribution_is_an_error(bad, kw):
    """A NaN / +inf logit, or a row of -inf only (a model that overflowed), has no distribution: every path of the
    torch sampler raises ValueError naming the row (as the fused op does), not an IndexError of its own gather, a
    multinomial error, or a token with a NaN log-prob."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    suppress = None
    if bad == "all -inf but suppressed":  # the only finite logits are ids the sampler must never pick
        logits[1, 2:] = float("-inf")
        suppress = torch.tensor([0, 1])
    elif bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 7] = float(bad)
    with _ext.python_only():
        with pytest.raises(ValueError, match="row 1 of the logits"):
            sample_tokens(logits, generator=torch.Generator().manual_seed(0), suppress_token_ids=suppress, **kw)
        tok, logp = sample_tokens(logits[[0, 2]], generator=torch.Generator().manual_seed(0),
                                  **{k: (v[:2] if k == "uniform" else v) for k, v in kw.items()})
    assert torch.isfinite(logp).all() and ((tok >= 0) & (tok < 20)).all()


class CharTokenizer:
    """Token i decodes to chr(i); 0 is a special token."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def get_vocab(self):
        return {"<|im_end|>": 0, "a": 97}


def test_stop_checker():
    tok = CharTokenizer()
    ids = [ord(c) for c in "abc</answer>xyz"]
    checker = StopChecker(tok, {0}, stop=["</answer>", "STOP"])
    reasons = [checker.check(ids[:i]) for i in range(1, len(ids) + 1)]
    first = reasons.index("stop")
    assert first == len("abc</answer>") - 1 and all(r is None for r in reasons[:first])
    assert checker.final_text(ids, "stop") == "abc</answer>"
    assert checker.check([97, 0]) == "eos"
    assert checker.final_text([97, 98, 0], "eos") == "ab"
    assert StopChecker(tok, {0}).check(ids) is None
    with pytest.raises(ValueError, match="must not be empty"):
        StopChecker(tok, {0}, stop=[""])


def test_eos_ids_from_tokenizer_and_generation_config():
    assert eos_token_ids_of(CharTokenizer(), {"eos_token_id": [5, 6]}) == {0, 5, 6}
    assert eos_token_ids_of(CharTokenizer(), {"eos_token_id": 9}, extra=[3]) == {0, 3, 9}


def test_suppressed_tokens_are_never_drawn_and_logprobs_are_of_the_rest():
    """Suppression removes the ids from the distribution: the reported log-prob is renormalised over the other
    ids (what vLLM reports with its logit bias and what training scores), not the full softmax's."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]]).expand(500, -1)
    suppress = torch.tensor([0, 2])
    kept = torch.log_softmax(logits[0].index_fill(0, suppress, float("-inf")), -1)
    tok, logp = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(0), suppress_token_ids=suppress)
    assert set(tok.tolist()) <= {1, 3} and set(tok.tolist()) == {1, 3}
    torch.testing.assert_close(logp, kept[tok])
    assert not torch.allclose(logp, torch.log_softmax(logits[0], -1)[tok])
    greedy, glogp = sample_tokens(logits[:2], temperature=0.0, suppress_token_ids=suppress)
    assert greedy.tolist() == [1, 1]
    torch.testing.assert_close(glogp, kept[[1, 1]])


def test_inverse_cdf_draws_follow_the_distribution_and_respect_the_support():
    """With one uniform number per row (the engine's per-slot draws), the token is the inverse CDF of the
    allowed distribution: a grid of uniforms hits every token in proportion to its probability, and no
    uniform — 0 or the largest float below 1 — lands on a suppressed or truncated token."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 3.0, 0.0]])
    grid = 6000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    rows = logits.expand(grid, -1)
    tokens, logp = sample_tokens(rows, temperature=0.8, uniform=u.float())
    probs = torch.softmax(logits[0] / 0.8, -1)
    counts = torch.bincount(tokens, minlength=6).double()
    torch.testing.assert_close(counts / grid, probs.double(), atol=2.0 / grid, rtol=0)
    torch.testing.assert_close(logp, torch.log_softmax(logits[0] / 0.8, -1)[tokens])  # untruncated behaviour log-probs
    edge = torch.tensor([0.0, 0.5, 1.0 - 2.0 ** -24])
    three = logits.expand(3, -1)
    for kw in (dict(suppress_token_ids=torch.tensor([4, 5])), dict(top_k=2), dict(top_p=0.5), dict(top_k=3, top_p=0.9)):
        allowed = set(range(6))
        if "suppress_token_ids" in kw:
            allowed -= {4, 5}
        if "top_k" in kw or "top_p" in kw:
            kept = filter_logits(logits / 0.8, top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0))
            allowed &= set(torch.isfinite(kept[0]).nonzero().flatten().tolist())
        tok, _ = sample_tokens(three, temperature=0.8, uniform=edge, **kw)
        assert set(tok.tolist()) <= allowed, (kw, tok)
        assert tok[0] == min(allowed) and tok[2] == max(allowed)  # the ends of the CDF


def test_same_device_reads_a_bare_cuda_as_the_current_index(monkeypatch):
    """A generator made with device="cuda" reports `cuda`, a tensor on it `cuda:0`: the same device. A plain `!=`
    said they differ, and the engine refused every sampled rollout on a GPU (seen on an H200)."""
    from megatron_vlm.inference.sampling import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert same_device("cuda:0", "cuda")
    assert not same_device("cuda", "cuda:1")
    assert not same_device("cpu", "cuda:0")
    assert same_device("cpu", torch.device("cpu"))


def test_same_device_without_a_current_device_compares_indices():
    from megatron_vlm.inference.sampling import same_device

    assert not same_device(torch.device("meta", 0), torch.device("meta"))  # torch.meta has no current_device
    assert same_device(torch.device("meta", 0), torch.device("meta", 0))


def test_a_row_with_only_suppressed_finite_logits_is_an_error_on_the_fused_path_too():
    """The fused CPU draw (`sample_rows`, when the extension is built) samples the row's distribution and the
    suppression is applied after it: a row whose only finite logits are suppressed ids gave a token of
    probability 0 with a NaN log-prob; it raises as the torch path does."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    logits[1, 2:] = float("-inf")
    with pytest.raises(ValueError, match="row 1 of the logits"):
        sample_tokens(logits, temperature=1.0, uniform=torch.full((3,), 0.5), suppress_token_ids=torch.tensor([0, 1]))
