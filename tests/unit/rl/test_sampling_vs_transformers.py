"""Token selection of the rollout engine against transformers' own logits processors (`TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, applied in the order `generate` applies them: temperature, top-k, top-p):
the kept set on the same logits (ties at the top-k boundary, top_p = 1, top_k >= vocab, peaked and flat rows,
bf16-rounded and -inf logits), the draw frequencies of both sampling paths (multinomial with a generator, the
inverse CDF with uniforms) under exact binomial bounds, greedy ties as torch.argmax breaks them, and the reported
log-probs of the suppressed-token distribution as the trainer's `masked_token_logprobs` computes them."""
import math

import pytest
import torch
from transformers.generation.logits_process import (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from megatron_vlm import _ext
from megatron_vlm.inference.sampling import filter_logits, sample_tokens
from megatron_vlm.inference.stopping import StopChecker
from megatron_vlm.training.masked_vocab import masked_token_logprobs

NEG = float("-inf")


def hf_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers on float32 logits (generate upcasts the last logits to float32 before them)."""
    s = logits.float()
    if temperature != 1.0:
        s = TemperatureLogitsWarper(temperature)(None, s)
    if top_k:
        s = TopKLogitsWarper(top_k)(None, s)
    if top_p < 1.0:
        s = TopPLogitsWarper(top_p)(None, s)
    return s


def kept(filtered: torch.Tensor) -> torch.Tensor:
    return filtered > NEG


def no_tie_at_a_boundary(probs: torch.Tensor) -> bool:
    """A row whose kept set is fixed by the values alone: no two equal finite probabilities (a tie at a top-p
    boundary is broken by the sort order, which neither transformers nor this engine defines)."""
    finite = probs[probs > 0]
    return finite.unique().numel() == finite.numel()


def test_top_k_keeps_every_token_tied_with_the_kth():
    """transformers (and vLLM) drop only tokens strictly below the k-th largest logit: a tie at the boundary keeps
    all tied tokens (with bf16 logits such ties are common), so no tied token is excluded by its index."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for k in (1, 2, 3, 4):
        ref = kept(hf_filtered(logits, 1.0, k, 1.0))
        assert torch.equal(kept(filter_logits(logits, top_k=k)), ref), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 4.0, 40.0])  # flat .. very peaked
def test_kept_set_equals_transformers(dtype, scale):
    g = torch.Generator().manual_seed(int(scale * 1000) + (dtype == torch.bfloat16))
    checked = 0
    for trial in range(150):
        vocab = int(torch.randint(2, 50, (1,), generator=g))
        logits = (torch.randn(4, vocab, generator=g) * scale).to(dtype)
        if trial % 4 == 0:  # a model that masked part of the vocabulary
            logits[:, : vocab // 3] = NEG
        temperature = (1.0, 0.7, 1.6)[trial % 3]
        top_k = int(torch.randint(0, vocab + 3, (1,), generator=g))  # past the vocabulary too
        top_p = (1.0, 0.95, 0.6, 0.3, 1e-6)[trial % 5]
        ref = hf_filtered(logits, temperature, top_k, top_p)
        ours = filter_logits(logits.float() / temperature, top_k=top_k, top_p=top_p)
        for r in range(4):
            probs = torch.softmax(logits[r].float() / temperature, -1)
            if not no_tie_at_a_boundary(probs) and top_p < 1.0:
                continue
            assert torch.equal(kept(ours[r]), kept(ref[r])), (trial, r, top_k, top_p)
            assert torch.equal(ours[r][kept(ours[r])], ref[r][kept(ref[r])])  # kept values untouched
            checked += 1
    assert checked > 300


def test_top_p_one_and_top_k_past_the_vocabulary_keep_everything():
    logits = torch.tensor([[0.5, NEG, 2.0, -1.0]])
    assert filter_logits(logits, top_k=4, top_p=1.0) is logits
    assert filter_logits(logits, top_k=9, top_p=1.0) is logits
    assert torch.equal(kept(hf_filtered(logits, 1.0, 9, 1.0)), kept(logits))


def test_a_tiny_top_p_keeps_exactly_the_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 100, generator=g) * 0.01  # nearly flat: the argmax holds ~1 % of the mass
    out = filter_logits(logits, top_p=1e-8)
    assert torch.equal(kept(out), kept(hf_filtered(logits, 1.0, 0, 1e-8)))
    assert torch.equal(kept(out).sum(-1), torch.ones(8, dtype=torch.long))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("top_p", [0.99, 0.999, 0.9999])
def test_a_top_p_near_one_keeps_the_tail_of_a_real_vocabulary(top_p):
    """A Qwen-sized vocabulary (151,936 ids) whose tail holds much of the mass: the kept set is transformers' and the
    exact one (float64) but for tokens within float32 rounding of the boundary (transformers rounds 1 - top_p,
    vLLM 1 - float32(top_p): one or two ~1e-8 tokens apart), where a float32 running sum from the most likely token
    down (near 1, off by ~1e-5 after 150k terms) dropped ~3e-5 of kept mass, 30-40 % of the tail top_p = 0.9999
    keeps, hundreds of tokens. transformers and vLLM sum from the least likely token up, where the boundary lies."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 151936, generator=g) * 3.0
    ours = kept(filter_logits(logits, top_p=top_p))
    probs = torch.softmax(logits.double(), -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    exact = torch.zeros_like(ours).scatter_(-1, order, (sorted_probs.cumsum(-1) - sorted_probs) < top_p)
    for ref in (kept(hf_filtered(logits, 1.0, 0, top_p)), exact):
        assert int((ref ^ ours).sum()) <= 6
        assert float((probs * (ref ^ ours)).sum(-1).max()) < 1e-7


def _binomial_bounds_hold(counts: torch.Tensor, probs: torch.Tensor, n: int, z: float = 5.0) -> None:
    """Every token's count within z standard deviations of n p (two-sided; p = 0 must give 0 draws)."""
    for i, (c, p) in enumerate(zip(counts.tolist(), probs.tolist())):
        if p == 0:
            assert c == 0, i
        else:
            assert abs(c - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1, (i, c, n * p)


@pytest.mark.parametrize("path", ["multinomial", "inverse_cdf", "inverse_cdf_torch"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 4, 1.0), (0.8, 0, 0.6),
                                                       (0.8, 0, 0.9), (1.3, 5, 0.5)])
def test_draw_frequencies_follow_the_transformers_distribution(path, temperature, top_k, top_p):
    """Many draws from one row, both sampling paths, with ties at the top-k boundary in the row: the frequencies
    are those of softmax(transformers' filtered logits) within 5 sigma, and tokens outside its support never
    come. The top-p boundaries chosen fall between distinct values (a tie there is broken by sort order)."""
    logits = torch.tensor([[2.0, 1.2, 1.2, 0.7, 0.7, 0.7, -0.5, NEG, -2.0, 0.0]])
    vocab, n = logits.shape[-1], 20000
    probs = torch.softmax(hf_filtered(logits, temperature, top_k, top_p), -1)[0]
    for value in logits[0].unique():  # tied tokens are all kept or all dropped
        assert probs[logits[0] == value].gt(0).unique().numel() == 1, value
    g = torch.Generator().manual_seed(11)
    rows = logits.expand(n, -1).contiguous()
    if path == "multinomial":
        tokens, lp = sample_tokens(rows, temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
    else:
        uniform = torch.rand(n, generator=g)
        if path == "inverse_cdf_torch":
            with _ext.python_only():
                tokens, lp = sample_tokens(rows, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)
        else:
            tokens, lp = sample_tokens(rows, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)
    _binomial_bounds_hold(torch.bincount(tokens, minlength=vocab), probs, n)
    # reported: log_softmax(logits / T) over the whole vocabulary, whatever top-k / top-p kept
    full = torch.log_softmax(logits[0].double() / temperature, -1)
    torch.testing.assert_close(lp.double(), full[tokens], atol=2e-6, rtol=0)


def test_greedy_breaks_ties_as_argmax_and_reports_the_temperature_one_logprobs():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [NEG, 2.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    tokens, lp = sample_tokens(logits, temperature=0.0)
    assert torch.equal(tokens, torch.argmax(logits, -1))
    assert tokens.tolist() == [1, 2, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    # top-k / top-p do not change greedy
    assert torch.equal(sample_tokens(logits, temperature=0.0, top_k=1, top_p=0.1)[0], tokens)


SUPPRESSED = [1, 6, 9]  # stand-ins for a VLM's vision placeholders


def hf_suppressed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' `SuppressTokensLogitsProcessor` (a processor: it runs before the warpers) then the warpers."""
    s = SuppressTokensLogitsProcessor(SUPPRESSED, device="cpu")(torch.zeros(1, 1, dtype=torch.long), logits.float())
    return hf_filtered(s, temperature, top_k, top_p)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.2, 0, 0.75), (0.9, 4, 0.85)])
def test_suppressed_tokens_are_removed_before_top_k_and_top_p(fused, temperature, top_k, top_p):
    """Top-k / top-p choose among the tokens that may be drawn (a suppressed id takes no top-k place), as with
    transformers' suppression before its warpers; the suppressed ids never come."""
    logits = torch.tensor([[1.5, 3.0, 1.0, 0.6, -0.2, 0.3, 2.5, -1.0, NEG, 2.8]])
    vocab, n = logits.shape[-1], 20000
    probs = torch.softmax(hf_suppressed(logits, temperature, top_k, top_p), -1)[0]
    assert no_tie_at_a_boundary(probs)
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(5))
    with _ext.python_only() if not fused else torch.no_grad():
        tokens, _ = sample_tokens(logits.expand(n, -1).contiguous(), temperature=temperature, top_k=top_k,
                                  top_p=top_p, uniform=uniform, suppress_token_ids=torch.tensor(SUPPRESSED))
    _binomial_bounds_hold(torch.bincount(tokens, minlength=vocab), probs, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 0, 1.0), (0.8, 5, 0.9)])
@pytest.mark.parametrize("shift", [0.0, 4.0, 30.0])  # 30: the suppressed ids hold nearly all of the mass
def test_reported_logprobs_equal_the_trainers_masked_logprobs(dtype, temperature, top_k, top_p, shift):
    """On the same LM-head logits the rollout's behaviour log-prob is what training computes for the same token
    (`masked_token_logprobs` over the fused kernel's full-softmax log-prob, at the rollout's temperature; greedy
    reports temperature 1), on the fused C++ draw, the ATen draws and greedy."""
    g = torch.Generator().manual_seed(int(shift) + int(temperature * 10))
    vocab, rows, h = 64, 48, 16
    hidden = torch.randn(rows, h, generator=g).to(dtype)
    weight = (torch.randn(vocab, h, generator=g) * 0.5).to(dtype)
    weight[SUPPRESSED] += shift / 4 * hidden.float().mean(0).sign().to(dtype)  # mass on the suppressed ids
    logits = hidden.float() @ weight.float().t()  # bf16 weights, fp32 logits (the trainer's kernels' too)
    t = temperature or 1.0
    for fused in (True, False):
        with _ext.python_only() if not fused else torch.no_grad():
            tokens, lp = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                       uniform=torch.rand(rows, generator=g), suppress_token_ids=torch.tensor(SUPPRESSED))
        assert not torch.isin(tokens, torch.tensor(SUPPRESSED)).any()
        full = torch.log_softmax(logits.double() / t, -1).gather(-1, tokens[:, None]).squeeze(-1)
        trainer, _ = masked_token_logprobs(hidden.double(), weight.double(), tokens, full, None, SUPPRESSED,
                                           temperature=t)
        torch.testing.assert_close(lp.double(), trainer, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["fused", "inverse_cdf_torch", "multinomial"])
@pytest.mark.parametrize("gap", [60.0, 95.0, 120.0])
def test_a_row_dominated_by_suppressed_ids_draws_from_the_rest(path, gap):
    """A row where the suppressed ids hold all but e^-gap of the mass (a model sure of a vision token) still has
    a distribution over the other ids: the draw follows it, as transformers' suppression gives. The other ids'
    full-softmax probabilities underflow float32 past ~87 nats: the fused draw then picked them uniformly
    (a wrong draw with the right reported log-prob) and the torch draws raised."""
    logits = torch.tensor([[gap, 0.0, 1.0, 0.5, -0.3, NEG]])
    suppressed = torch.tensor([0])
    vocab, n = logits.shape[-1], 20000
    s = SuppressTokensLogitsProcessor([0], device="cpu")(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    probs = torch.softmax(s, -1)[0]
    g = torch.Generator().manual_seed(2)
    rows = logits.expand(n, -1).contiguous()
    if path == "multinomial":
        tokens, lp = sample_tokens(rows, temperature=1.0, generator=g, suppress_token_ids=suppressed)
    else:
        with _ext.python_only() if path != "fused" else torch.no_grad():
            tokens, lp = sample_tokens(rows, temperature=1.0, uniform=torch.rand(n, generator=g),
                                       suppress_token_ids=suppressed)
    _binomial_bounds_hold(torch.bincount(tokens, minlength=vocab), probs, n)
    torch.testing.assert_close(lp, torch.log_softmax(s[0], -1)[tokens], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def byte_bpe():
    from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.mark.parametrize("text, stop", [("the answer is 4</answer> more", "</answer>"),
                                        ("the answer is 4</answer> more", "is 4<"),
                                        ("x é 答案 y 答案", "答案"), ("x é y", "é"), ("no stop here", "</answer>")])
def test_stop_strings_end_at_the_first_prefix_whose_decoding_holds_them(byte_bpe, text, stop):
    """On a byte-level BPE (the `tokenizers` library; characters outside its merges are split over byte tokens),
    a completion stops at the first token after which the tokenizer's own decoding of the completion contains a
    stop string (one spanning tokens, or a character split over bytes), and no earlier; its text ends right
    after the first occurrence; an EOS id ends it at that token."""
    ids = byte_bpe.encode(text, add_special_tokens=False)
    checker = StopChecker(byte_bpe, {byte_bpe.eos_token_id}, stop=["@@never@@", stop])
    fired = [i for i in range(1, len(ids) + 1) if checker.check(ids[:i]) == "stop"]
    expect = next((i for i in range(1, len(ids) + 1) if stop in byte_bpe.decode(ids[:i])), None)
    assert (fired[0] if fired else None) == expect
    if expect is not None:
        assert checker.final_text(ids[:expect], "stop") == text[: text.index(stop) + len(stop)]
    assert checker.check(ids[:2] + [byte_bpe.eos_token_id]) == "eos"
