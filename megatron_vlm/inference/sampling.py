"""Next-token selection for rollouts: temperature, top-k, top-p (nucleus) and greedy, returning the
chosen tokens with their behaviour log-probs.

Numerics: logits are taken in float32. The behaviour log-prob of a token is read from
log_softmax(logits / temperature) over the whole vocabulary — the distribution the trainer
recomputes with `kernels.linear_token_logprobs(..., temperature=...)` — not from the top-k / top-p
truncated one (truncation only restricts the support of the draw, as in vLLM and verl). Greedy
(temperature 0) reports log_softmax(logits) at temperature 1.

`suppress_token_ids` are never drawn (nor picked greedily). The rollout engine suppresses a VLM's vision
tokens: a generated `<|image_pad|>` would be read as an image slot by the training forward (whose
placeholder count must equal the image features), so a completion must never contain one. Unlike
top-k / top-p, suppression changes the reported log-prob: it is of the distribution with those ids
removed and renormalised, log p(y) - log(1 - sum_s p_s) (at the reported temperature), which is what
vLLM reports (its -100 logit bias on the same ids) and what every RL log-prob of training computes
(`masked_token_ids`, training/masked_vocab.py): the same distribution everywhere, so the importance
ratios carry no log(1 - p(vision)) term.

Top-k and top-p share one ascending sort: a token below the k-th largest value is dropped, then a token
is dropped when the probability mass up to and including it, summed from the least likely (within the kept set,
renormalised), is at most 1 - top_p, so the most likely token always survives. That is transformers' order and
rule (its `TopKLogitsWarper` then `TopPLogitsWarper`, after the temperature) and vLLM's (`apply_top_k_top_p`):
every token tied with the k-th value stays, so more than k may remain (frequent with bf16 logits) and no tied
token is dropped for its index; ties at the top-p boundary are broken by the sort order, as in both. Summed
from the tail, the boundary is exact to float32 rounding of the tail's mass even with top_p near 1 over a
150k vocabulary. There is no min_p.

The draw itself is of that renormalised distribution even when the suppressed ids hold all but e^-100 of
the mass (a model sure of a vision token), where the other ids' full-softmax probabilities underflow float32:
the torch path scales the probabilities by the best allowed one, and the fused path below draws such rows
(suppressed mass above one half) again from their logits with the suppressed ids set to -inf.

On the CPU (float32 logits, `megatron_vlm._C` built, not inside `_ext.python_only()`) the untruncated
draw with given uniforms — what the rollout engine asks at every decoding step without top-k / top-p —
runs fused in C++ (csrc/cpu_sampling.cpp `sample_rows`: three passes over a row instead of the five
ATen passes and three [N, V] buffers below, same inverse-CDF rule; tokens equal this module's except
when a uniform lands within float rounding of a CDF step, log-probs within ~1e-6).

A row without a distribution (a NaN or +inf logit, or only -inf ones outside `suppress_token_ids`: a model
that overflowed) raises ValueError naming the row, as `sample_rows` does, instead of an IndexError of the
inverse-CDF gather, a multinomial error or a token with a NaN log-prob. The rows are found from [N] values
each path computes anyway (the total mass, the picked token's logit and log-prob) with one host read per
call, on CPU tensors only: on an accelerator that read would add a device sync to every decoding step, so
there such a row gets a token with a non-finite log-prob (the inverse-CDF draw clamped to the vocabulary), which
the rollout engines refuse with a ValueError naming the prompt from the host read they do at every step anyway.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["filter_logits", "same_device", "sample_tokens"]


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when a and b name one device: `cuda` (a generator's device) and `cuda:0` (a tensor's) are the
    same one when 0 is the current device. Plain `==` says they differ."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index or a.type == "cpu":
        return True
    module = getattr(torch, a.type, None)
    if module is None or not hasattr(module, "current_device"):  # no notion of a current device: indices decide
        return False
    current = module.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def filter_logits(scaled: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """`scaled` [N, V] (already divided by the temperature) with the tokens outside the top-k /
    top-p set set to -inf."""
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    vocab = scaled.shape[-1]
    k_active = 0 < top_k < vocab
    if not k_active and top_p >= 1.0:
        return scaled
    # ascending, as transformers and vLLM sort: the running sum starts at the least likely token, so where the top-p
    # boundary lies it holds the tail's small mass to float32 precision (a sum from the top is within ~1e-5 of 1
    # there after 150k terms, which moved the boundary by ~3e-5 of mass, hundreds of tokens, at top_p = 0.999)
    sorted_logits, order = scaled.sort(dim=-1)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if k_active:  # below the k-th largest value: a token tied with it stays (transformers' and vLLM's top-k)
        drop |= sorted_logits < sorted_logits[:, vocab - top_k:vocab - top_k + 1]
    if top_p < 1.0:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # dropped while the tail up to it holds at most 1 - top_p: vLLM's threshold, 1 - float32(top_p) (compared in
        # float32, as a Python number is); the mass from the first kept token up reaches top_p
        drop |= probs.cumsum(dim=-1) <= 1.0 - float(torch.tensor(top_p, dtype=torch.float32))
    drop[:, -1] = False
    mask = torch.zeros_like(drop).scatter_(-1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


def _fused_cpu(x: torch.Tensor) -> bool:
    """The C++ sampler takes x: what the csrc kernels take (a plain float32 CPU tensor), with the extension loaded."""
    from megatron_vlm import _ext
    from megatron_vlm.kernels.csrc.layer_ops import _fits

    return x.shape[-1] > 0 and _fits(x) and _ext.available()


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    suppress_token_ids: Optional[torch.Tensor] = None,
    uniform: Optional[torch.Tensor] = None,
    heavy_rows: Optional[list] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N] int64, behaviour log-probs [N] float32) for next-token logits [N, V].

    `uniform`: [N] draws from U[0, 1), one per row: the token is then found by inverse CDF (the first
    token whose cumulative probability exceeds u * total), so the caller decides which random number
    each row gets and a row needs one number, not V; without it, `torch.multinomial` with `generator`.

    `heavy_rows`: a list, to leave the log-probs of the rows where `suppress_token_ids` hold most of the mass
    (`_renormalised`) to the caller, who reads which rows they are with a read of its own (the rollout engine's one
    read per step) instead of one here (a `nonzero`, a device sync): the list receives (flags [N] bool on the
    device, `exact(rows)` -> those rows' log-probs [len(rows)] on the device). The log-probs returned hold the
    approximate values in those rows. Not taken by the CPU's fused draw, which draws those rows again."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, vocab], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    x = logits.float()
    suppress = suppress_token_ids is not None and suppress_token_ids.numel() > 0
    sup = suppress_token_ids if suppress_token_ids is not None else torch.empty(0, dtype=torch.long)
    truncated = (0 < top_k < x.shape[-1]) or top_p < 1.0
    if uniform is not None and temperature > 0 and uniform.shape != (x.shape[0],):
        raise ValueError(f"uniform: expected shape ({x.shape[0]},), got {tuple(uniform.shape)}")
    if uniform is not None and temperature > 0 and not truncated and _fused_cpu(x):
        from megatron_vlm.kernels.csrc.layer_ops import _ops

        tokens, lp = _ops().sample_rows(x.contiguous(), uniform.float().contiguous(),
                                        suppress_token_ids if suppress else None, float(temperature))
        if not suppress:
            return tokens, lp
        lp, heavy = _renormalised(x, tokens, lp, sup, float(temperature))
        # sample_rows raised for a row without any distribution; one whose only finite logits are suppressed ids
        # leaves a token of probability 0: its renormalised log-prob is not finite (one sum read, as below)
        if not math.isfinite(float(lp.sum())):
            _raise_for_rows(~lp.isfinite())
        if heavy.numel():  # the suppressed ids hold most of the mass: drawn again from the rest alone (docstring)
            rest = x.index_select(0, heavy).index_fill_(-1, sup.to(x.device), float("-inf"))
            t2, lp2 = _ops().sample_rows(rest, uniform.float().index_select(0, heavy).contiguous(), None,
                                         float(temperature))
            tokens, lp = tokens.index_put((heavy,), t2), lp.index_put((heavy,), lp2)
        return tokens, lp

    def allowed(t: torch.Tensor, fill: float) -> torch.Tensor:
        return t.index_fill(-1, sup.to(t.device), fill) if suppress else t

    check = x.device.type == "cpu"  # rows without a distribution are found on the CPU only (module docstring)
    finite: list[torch.Tensor] = []  # [N] values each path has anyway, all finite in a row with a distribution
    if temperature == 0:
        candidates = allowed(x, float("-inf"))
        tokens = candidates.argmax(dim=-1)
        logp = torch.log_softmax(x, dim=-1)
        if check and suppress:  # the best allowed logit is -inf: nothing to pick (NaN / +inf show in the log-prob)
            finite.append(candidates.gather(-1, tokens[:, None]).squeeze(-1))
    else:
        scaled = x if temperature == 1 else x / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        if truncated:
            probs = filter_logits(allowed(scaled, float("-inf")), top_k=top_k, top_p=top_p).softmax(dim=-1)
        elif suppress:  # exp(logp - the best allowed logp), suppressed ids 0: no underflow however much mass they hold
            probs = logp.index_fill(-1, sup.to(logp.device), float("-inf"))
            best = probs.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(probs.dtype).min)  # none allowed: zeros
            probs = probs.sub_(best).exp_()  # in place: one [N, V] buffer, as exp()
        else:  # no truncation: the untruncated probabilities
            probs = logp.exp()
        if uniform is not None:
            cdf = probs.cumsum_(dim=-1)  # probs is this function's own buffer: the running sum in place
            total = cdf[:, -1:]
            # target < total strictly, so the first token with cdf > target (right=True) exists and has
            # probability > 0 (cdf rises there), never a suppressed or truncated token
            target = torch.minimum(uniform.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
            # a NaN or zero total (log: NaN / -inf): the search ran off the end; clamped, so the gather below stays
            # in the vocabulary (on an accelerator too) and the row's log-prob is not finite
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=x.shape[-1] - 1)
            if check:
                finite.append(total.squeeze(-1).log())
        else:
            if generator is not None and not same_device(generator.device, probs.device):
                raise ValueError(f"generator: on {generator.device}, logits on {probs.device}")
            try:
                tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            except RuntimeError:  # on its error path only: which row, when the cause is one without a distribution
                _raise_for_rows(~(probs.sum(dim=-1) > 0))
                raise
    lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if check:  # a picked token's log-prob is finite in a row with a distribution; one sum read (the fast test)
        finite.append(lp)
        if not math.isfinite(float((finite[0] if len(finite) == 1 else torch.cat(finite)).sum())):  # which row:
            _raise_for_rows(~torch.stack(finite).isfinite().all(dim=0))  # (none if the sum overflowed)
    if suppress:
        t = float(temperature) or 1.0
        if heavy_rows is None:
            lp = _renormalised(x, tokens, lp, sup, t)[0]
        else:
            lp, flags = _renormalised_approx(x, tokens, lp, sup, t)
            heavy_rows.append((flags, lambda rows: _exact_rows(x, tokens, sup, t, rows)))
    return tokens, lp


def _raise_for_rows(bad: torch.Tensor) -> None:
    """ValueError naming the first row flagged in `bad` [N], if any (a host read: the caller decides where)."""
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"sample_tokens: row {row} of the logits has a NaN or +inf value, or only -inf ones "
                         "(outside suppress_token_ids): no distribution to sample from")


# rows whose kept mass 1 - P is below this get their log-prob from a log_softmax over the kept ids: the
# correction divides the rounding of log p by 1 - P (and P may round to 1)
_MIN_KEPT = 0.5


def _renormalised(x: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, sup: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`logp` (of `tokens` under softmax(x / temperature)) made the log-prob under that softmax with the `sup` ids
    removed, the rows where those ids hold more than half of the mass): log p_s = (x_s - x_token) / T + log p(token)
    needs only the few suppressed logits (module docstring)."""
    out, bad = _renormalised_approx(x, tokens, logp, sup, temperature)
    rows = bad.nonzero().squeeze(-1)
    if rows.numel():  # rare rows where the suppressed ids hold most of the mass: exactly, from their logits
        out = out.index_put((rows,), _exact_rows(x, tokens, sup, temperature, rows))
    return out, rows


def _renormalised_approx(x: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, sup: torch.Tensor,
                         temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_renormalised`'s log-probs from the suppressed logits alone, and [N] bool: the rows where the suppressed ids
    hold more than half of the mass (their values are not exact: `_exact_rows`). No host read."""
    sup = sup.to(x.device)
    x_tok = x.gather(-1, tokens[:, None])
    log_ps = (x.index_select(-1, sup) - x_tok) / temperature + logp[:, None]
    mass = log_ps.exp().sum(-1)
    return logp - torch.log1p(-mass.clamp(max=1.0 - _MIN_KEPT)), mass > 1.0 - _MIN_KEPT


def _exact_rows(x: torch.Tensor, tokens: torch.Tensor, sup: torch.Tensor, temperature: float, rows) -> torch.Tensor:
    """The log-probs of `tokens` in `rows` (a tensor or a list of row indices) under softmax(x / temperature) with
    the `sup` ids removed, from the rows' whole logits."""
    rows = torch.as_tensor(rows, dtype=torch.long).to(x.device, non_blocking=True) if isinstance(rows, list) else rows
    exact = torch.log_softmax(x[rows].index_fill(-1, sup.to(x.device), float("-inf")) / temperature, dim=-1)
    return exact.gather(-1, tokens[rows, None]).squeeze(-1)
