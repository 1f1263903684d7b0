"""The policy-loss variants against plain-torch transcriptions of their papers' equations, written
here sequence by sequence (float64, independent of megatron_vlm.rl.losses): value and gradient, on
padded [B, T] and packed [N] inputs, with responses of length 1 and longer.

    GSPO        Zheng et al. 2025, eq. (5)-(7): J = 1/G sum_i min(s_i A_i, clip(s_i, 1-e_l, 1+e_h) A_i),
                s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    GSPO-token  same paper, eq. (13)-(14): s_it = sg[s_i] pi(y_it) / sg[pi(y_it)], J averages
                min(s_it A_it, clip(s_it) A_it) over each sequence's tokens, then over sequences
    CISPO       MiniMax-M1 2025, eq. (4)-(5): J = 1/sum|o_i| sum_i sum_t sg(clip(r_it)) A_it log pi(o_it)
    Dr. GRPO    Liu et al. 2025: the clipped PPO term summed over tokens and divided by G x L_max
    TIS / MIS   Yao et al. 2025: tokens weighted by min(pi_old / pi_rollout, C); sequences with a
                geometric-mean ratio outside [1/C, C] removed
    entropy     loss - c * token-mean entropy

and the reductions: GSPO / GSPO-token with one-token responses equal the clipped loss; GSPO-token
with one advantage per sequence equals GSPO; TIS with identical rollout and training log-probs
changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.host_copies import keep_host_copy
from megatron_vlm.rl.losses import aggregate_loss, policy_loss, rollout_correction_mask
from megatron_vlm.testing.host_reads import HostReads

F64 = torch.float64
LENGTHS = (1, 3, 5, 1, 4)
RANGES = {"ppo": (0.2, 0.28), "gspo_paper": (3e-4, 4e-4)}


# ---------------------------------------------------------------- data and layouts
def _data(seed: int, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    old = [-(torch.rand(n, generator=g, dtype=F64) * 2 + 0.1) for n in lengths]
    shift = [torch.randn(n, generator=g, dtype=F64) * 0.3 for n in lengths]
    shift[-1] = torch.zeros(lengths[-1], dtype=F64)  # one sequence exactly on-policy: s = 1, inside any range
    logp = [o + s for o, s in zip(old, shift)]
    adv_seq = torch.randn(len(lengths), generator=g, dtype=F64)
    adv_tok = [torch.randn(n, generator=g, dtype=F64) for n in lengths]
    rollout = [o + torch.randn(n, generator=g, dtype=F64) * 0.5 for o, n in zip(old, lengths)]
    ent = [torch.rand(n, generator=g, dtype=F64) * 3 for n in lengths]
    return logp, old, adv_seq, adv_tok, rollout, ent


def _padded(seqs, fill):
    T = max(len(s) for s in seqs)
    x = torch.full((len(seqs), T), fill, dtype=seqs[0].dtype)
    m = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
        m[i, : len(s)] = True
    return x, m


def _ours(layout, logp, old, adv, *, seq_level_adv=False, extra=None, **kw):
    """Our loss and d loss / d logp per sequence, on the padded or the packed layout. Padding holds
    garbage (it must not matter). "device": the packed layout as a GPU job's trainer gives it (every tensor a
    device copy; the sequence ids, advantages and mask with their host copies, `megatron_vlm.host_copies`): the
    loss must read no device value (`HostReads`)."""
    if layout == "device":
        return _on_device(logp, old, adv, seq_level_adv=seq_level_adv, extra=extra or {}, **kw)
    lengths = [len(x) for x in logp]
    extra = extra or {}
    if layout == "padded":
        lp, mask = _padded(logp, 3.0)
        leaf = lp.clone().requires_grad_()
        od, _ = _padded(old, -9.0)
        a = adv if seq_level_adv else _padded(adv, 50.0)[0]
        more = {k: _padded(v, -2.0)[0] for k, v in extra.items()}
        out = policy_loss(leaf, od, a, mask, **more, **kw)
        out.loss.backward()
        return out, [leaf.grad[i, :n] for i, n in enumerate(lengths)]
    leaf = torch.cat(logp).clone().requires_grad_()
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    a = adv[seq_ids] if seq_level_adv else torch.cat(adv)
    more = {k: torch.cat(v) for k, v in extra.items()}
    out = policy_loss(leaf, torch.cat(old), a, torch.ones(len(seq_ids), dtype=torch.bool), seq_ids=seq_ids, **more, **kw)
    out.loss.backward()
    return out, list(torch.split(leaf.grad, lengths))


def _on_device(logp, old, adv, *, seq_level_adv, extra, **kw):
    lengths = [len(x) for x in logp]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    a = adv[seq_ids] if seq_level_adv else torch.cat(adv)
    mask = torch.ones(len(seq_ids), dtype=torch.bool)
    host = [seq_ids, a, mask]
    dev_ids, dev_a, dev_mask = (keep_host_copy(t.clone(), t) for t in host)
    leaf = torch.cat(logp).clone().requires_grad_()
    more = {k: torch.cat(v) for k, v in extra.items()}
    with HostReads(host=host) as reads:
        out = policy_loss(leaf, torch.cat(old), dev_a, dev_mask, seq_ids=dev_ids, **more, **kw)
    assert reads.total == 0, f"{reads.total} host reads of device values in the loss:\n{reads.report()}"
    out.loss.backward()
    return out, list(torch.split(leaf.grad, lengths))


def _check(layout, expected, expected_grads, out, grads):
    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-12, atol=1e-13)
    for i, (g, e) in enumerate(zip(grads, expected_grads)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-13, msg=f"{layout}: gradient of sequence {i}")


def _leaves(logp):
    return [x.clone().requires_grad_() for x in logp]


def _grads(loss, leaves):
    return list(torch.autograd.grad(loss, leaves))


# ---------------------------------------------------------------- transcriptions
def gspo_paper(logp, old, adv_seq, lo, hi, agg):
    """-J of GSPO: per sequence s_i = exp(1/|y_i| sum_t (log pi - log pi_old)); min(s A, clip(s) A);
    mean over sequences (seq-mean) or weighted by |y_i| (token-mean)."""
    terms, weights = [], []
    for lp, od, a in zip(logp, old, adv_seq):
        s = torch.exp((lp - od).sum() / len(lp))
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
        weights.append(float(len(lp)))
    if agg == "seq-mean":
        return -sum(terms) / len(terms)
    return -sum(w * t for w, t in zip(weights, terms)) / sum(weights)


def gspo_token_paper(logp, old, adv_tok, lo, hi):
    """-J of GSPO-token (seq-mean, as in the paper)."""
    J = 0.0
    for lp, od, a in zip(logp, old, adv_tok):
        s_i = torch.exp((lp - od).sum() / len(lp))
        s_it = s_i.detach() * torch.exp(lp) / torch.exp(lp).detach()
        J = J + torch.minimum(s_it * a, torch.clamp(s_it, 1 - lo, 1 + hi) * a).sum() / len(lp)
    return -J / len(logp)


def cispo_paper(logp, old, adv_tok, lo, hi):
    """-J of CISPO: token-level, 1 / sum |o_i| normalisation."""
    num, den = 0.0, 0
    for lp, od, a in zip(logp, old, adv_tok):
        r_hat = torch.clamp(torch.exp(lp - od), 1 - lo, 1 + hi).detach()
        num = num + (r_hat * a * lp).sum()
        den += len(lp)
    return -num / den


def ppo_token_terms(lp, od, a, lo, hi):
    r = torch.exp(lp - od)
    return torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)


def dr_grpo_paper(logp, old, adv_seq, lo, hi, max_len):
    """-J of Dr. GRPO: sum over all tokens of the clipped term / (G x max_len)."""
    J = sum(ppo_token_terms(lp, od, a, lo, hi).sum() for lp, od, a in zip(logp, old, adv_seq))
    return -J / (len(logp) * max_len)


def tis_paper(logp, old, adv_seq, rollout, lo, hi, C):
    """-J with truncated importance sampling, token-mean."""
    num, den = 0.0, 0
    for lp, od, a, ro in zip(logp, old, adv_seq, rollout):
        w = torch.clamp(torch.exp(od - ro), max=C)
        num = num + (w * ppo_token_terms(lp, od, a, lo, hi)).sum()
        den += len(lp)
    return -num / den


def mis_paper(logp, old, adv_seq, rollout, lo, hi, C):
    """-J with masked importance sampling (geometric-mean sequence rejection), token-mean over kept tokens."""
    num, den = 0.0, 0
    for lp, od, a, ro in zip(logp, old, adv_seq, rollout):
        geo = torch.exp((od - ro).mean())
        if not (1 / C <= geo <= C):
            num = num + 0.0 * lp.sum()
            continue
        num = num + ppo_token_terms(lp, od, a, lo, hi).sum()
        den += len(lp)
    return -num / den


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
@pytest.mark.parametrize("ranges", list(RANGES))
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_paper(layout, agg, ranges, seed):
    lo, hi = RANGES[ranges]
    logp, old, adv_seq, *_ = _data(seed)
    leaves = _leaves(logp)
    expected = gspo_paper(leaves, old, adv_seq, lo, hi, agg)
    out, grads = _ours(layout, logp, old, adv_seq, seq_level_adv=True, clip_ratio_low=lo, clip_ratio_high=hi,
                       loss_agg=agg, variant="gspo")
    exp_grads = _grads(expected, leaves)
    _check(layout, expected, exp_grads, out, grads)
    assert any(g.abs().sum() > 0 for g in grads)  # some sequence inside the range carries a gradient
    if ranges == "gspo_paper":  # tiny ranges: the off-policy sequences are clipped (zero gradient)
        assert sum(bool(g.abs().sum() == 0) for g in grads) >= 2


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
@pytest.mark.parametrize("ranges", list(RANGES))
def test_gspo_token_matches_paper(layout, ranges):
    lo, hi = RANGES[ranges]
    logp, old, _, adv_tok, *_ = _data(2)
    leaves = _leaves(logp)
    expected = gspo_token_paper(leaves, old, adv_tok, lo, hi)
    out, grads = _ours(layout, logp, old, adv_tok, clip_ratio_low=lo, clip_ratio_high=hi, loss_agg="seq-mean",
                       variant="gspo_token")
    _check(layout, expected, _grads(expected, leaves), out, grads)


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
def test_gspo_token_with_sequence_advantages_equals_gspo(layout):
    logp, old, adv_seq, *_ = _data(3)
    for lo, hi in RANGES.values():
        kw = dict(clip_ratio_low=lo, clip_ratio_high=hi, loss_agg="seq-mean")
        a, ga = _ours(layout, logp, old, adv_seq, seq_level_adv=True, variant="gspo", **kw)
        b, gb = _ours(layout, logp, old, adv_seq, seq_level_adv=True, variant="gspo_token", **kw)
        _check(layout, a.loss, ga, b, gb)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
def test_gspo_with_one_token_responses_equals_clip(layout, variant, agg):
    logp, old, adv_seq, *_ = _data(4, lengths=(1, 1, 1, 1, 1, 1))
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg=agg)
    clip, gc = _ours(layout, logp, old, adv_seq, seq_level_adv=True, variant="clip", **kw)
    gspo, gg = _ours(layout, logp, old, adv_seq, seq_level_adv=True, variant=variant, **kw)
    _check(layout, clip.loss, gc, gspo, gg)
    for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean"):
        torch.testing.assert_close(clip.metrics[k], gspo.metrics[k])


def test_gspo_refuses_per_token_advantages():
    logp, old, _, adv_tok, *_ = _data(0)
    for layout in ("packed", "device"):  # host copies that show varying advantages: the device check still refuses
        with pytest.raises(ValueError, match="gspo_token"):
            _ours(layout, logp, old, adv_tok, clip_ratio_low=0.2, clip_ratio_high=0.2, variant="gspo")
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.ones(4, dtype=torch.bool), clip_ratio_low=0.2,
                    clip_ratio_high=0.2, variant="gspo")


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("seed", [0, 5])
def test_cispo_matches_paper(layout, seed):
    lo, hi = 0.2, 0.28
    logp, old, _, adv_tok, *_ = _data(seed)
    leaves = _leaves(logp)
    expected = cispo_paper(leaves, old, adv_tok, lo, hi)
    out, grads = _ours(layout, logp, old, adv_tok, clip_ratio_low=lo, clip_ratio_high=hi, variant="cispo")
    _check(layout, expected, _grads(expected, leaves), out, grads)
    # every token keeps a gradient, clipped ones included (the point of CISPO vs PPO's clip)
    r = torch.exp(torch.cat(logp) - torch.cat(old))
    clipped = (r < 1 - lo) | (r > 1 + hi)
    assert clipped.any() and (torch.cat(grads)[clipped] != 0).all()
    assert out.metrics["clip_frac"].item() == pytest.approx(clipped.double().mean().item())


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
def test_seq_mean_token_sum_norm_is_dr_grpo(layout):
    lo, hi, L = 0.2, 0.28, 8
    logp, old, adv_seq, *_ = _data(6)
    leaves = _leaves(logp)
    expected = dr_grpo_paper(leaves, old, adv_seq, lo, hi, L)
    exp_grads = _grads(expected, leaves)
    out, grads = _ours(layout, logp, old, adv_seq, seq_level_adv=True, clip_ratio_low=lo, clip_ratio_high=hi,
                       loss_agg="seq-mean-token-sum-norm", max_response_length=L)
    _check(layout, expected, exp_grads, out, grads)
    # an explicit normaliser (the global G x L of a step split in micro-batches) gives the same
    out2, grads2 = _ours(layout, logp, old, adv_seq, seq_level_adv=True, clip_ratio_low=lo, clip_ratio_high=hi,
                         loss_agg="seq-mean-token-sum-norm", normalizer=len(logp) * L)
    _check(layout, expected, exp_grads, out2, grads2)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "seq-mean-token-sum-norm")


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
@pytest.mark.parametrize("C", [1.5, 3.0])
def test_tis_matches_transcription(layout, C):
    lo, hi = 0.2, 0.28
    logp, old, adv_seq, _, rollout, _ = _data(7)
    leaves = _leaves(logp)
    expected = tis_paper(leaves, old, adv_seq, rollout, lo, hi, C)
    out, grads = _ours(layout, logp, old, adv_seq, seq_level_adv=True, clip_ratio_low=lo, clip_ratio_high=hi,
                       rollout_correction="tis", rollout_correction_cap=C, extra={"rollout_logp": rollout})
    _check(layout, expected, _grads(expected, leaves), out, grads)
    rho = torch.exp(torch.cat(old) - torch.cat(rollout))
    assert out.metrics["tis_capped_frac"].item() == pytest.approx((rho > C).double().mean().item())
    if C == 1.5:
        assert 0 < out.metrics["tis_capped_frac"].item() < 1  # the data exercises the cap
    assert out.metrics["mismatch_ratio_max"].item() == pytest.approx(rho.max().item())
    assert out.metrics["mismatch_ratio_min"].item() == pytest.approx(rho.min().item())
    kl = (rho - 1 - torch.log(rho)).mean().item()  # k3 of KL(pi_rollout || pi_old)
    assert out.metrics["mismatch_kl"].item() == pytest.approx(kl, rel=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
def test_mis_matches_transcription(layout):
    lo, hi, C = 0.2, 0.28, 1.3
    logp, old, adv_seq, _, rollout, _ = _data(8)
    geo = torch.stack([torch.exp((o - r).mean()) for o, r in zip(old, rollout)])
    dropped = (geo < 1 / C) | (geo > C)
    assert dropped.any() and not dropped.all()  # the data exercises both sides
    leaves = _leaves(logp)
    expected = mis_paper(leaves, old, adv_seq, rollout, lo, hi, C)
    out, grads = _ours(layout, logp, old, adv_seq, seq_level_adv=True, clip_ratio_low=lo, clip_ratio_high=hi,
                       rollout_correction="mis", rollout_correction_cap=C, extra={"rollout_logp": rollout})
    _check(layout, expected, _grads(expected, leaves), out, grads)
    assert all(bool((grads[i] == 0).all()) for i in range(len(grads)) if dropped[i])
    assert out.num_tokens.item() == sum(len(x) for x, d in zip(logp, dropped) if not d)


@pytest.mark.parametrize("layout", ["padded", "packed", "device"])
@pytest.mark.parametrize("variant", ["clip", "gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_identical_rollout_and_training_logprobs_change_nothing(layout, variant, correction):
    logp, old, adv_seq, *_ = _data(9)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg="seq-mean", variant=variant)
    plain, gp = _ours(layout, logp, old, adv_seq, seq_level_adv=True, **kw)
    corr, gc = _ours(layout, logp, old, adv_seq, seq_level_adv=True, rollout_correction=correction,
                     rollout_correction_cap=2.0, extra={"rollout_logp": [o.clone() for o in old]}, **kw)
    _check(layout, plain.loss, gp, corr, gc)
    assert corr.metrics["mismatch_kl"].item() == 0.0 and corr.metrics["mismatch_ratio_mean"].item() == 1.0


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_entropy_bonus(layout):
    logp, old, adv_seq, _, _, ent = _data(10)
    leaves = _leaves(logp)
    ent_leaves = _leaves(ent)
    c = 0.01
    n = sum(len(x) for x in logp)
    expected = (-sum(ppo_token_terms(lp, od, a, 0.2, 0.2).sum() for lp, od, a in zip(leaves, old, adv_seq)) / n
                - c * sum(e.sum() for e in ent_leaves) / n)
    exp_grads = _grads(expected, leaves)
    # entropy carries a gradient too: our loss must pass it through
    lengths = [len(x) for x in logp]
    e_leaf = torch.cat(ent).clone().requires_grad_()
    if layout == "padded":
        lp_leaf = _padded(logp, 0.0)[0].clone().requires_grad_()
        od, mask = _padded(old, 0.0)
        ent_in = torch.zeros(mask.shape, dtype=F64).masked_scatter(mask, e_leaf)
        out = policy_loss(lp_leaf, od, adv_seq, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, entropy=ent_in, entropy_coef=c)
        out.loss.backward()
        grads = [lp_leaf.grad[i, :k] for i, k in enumerate(lengths)]
    else:
        lp_leaf = torch.cat(logp).clone().requires_grad_()
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        out = policy_loss(lp_leaf, torch.cat(old), adv_seq[seq], torch.ones(n, dtype=torch.bool), clip_ratio_low=0.2,
                          clip_ratio_high=0.2, entropy=e_leaf, entropy_coef=c)
        out.loss.backward()
        grads = list(torch.split(lp_leaf.grad, lengths))
    _check(layout, expected, exp_grads, out, grads)
    torch.testing.assert_close(e_leaf.grad, torch.cat(_grads(expected, ent_leaves)))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool), clip_ratio_low=0.2,
                    clip_ratio_high=0.2, entropy_coef=0.1)


def test_rollout_correction_errors_name_the_argument():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(z, z, torch.zeros(2), m, rollout_correction="tis", rollout_correction_cap=2.0, **kw)
    with pytest.raises(ValueError, match="rollout_correction_cap"):
        policy_loss(z, z, torch.zeros(2), m, rollout_correction="mis", rollout_correction_cap=1.0, rollout_logp=z, **kw)
    with pytest.raises(ValueError, match="rollout_correction"):
        policy_loss(z, z, torch.zeros(2), m, rollout_correction="is", rollout_logp=z, **kw)
    with pytest.raises(ValueError, match="behav_logp"):
        policy_loss(z, z, torch.zeros(2), m, rollout_correction="tis", rollout_correction_cap=2.0, rollout_logp=z,
                    behav_logp=z, **kw)
    with pytest.raises(ValueError, match="variant"):
        policy_loss(z, z, torch.zeros(2), m, variant="ppo", **kw)
    # MIS: geometric-mean ratios just inside [1/2, 2] are kept, just outside dropped, on both sides
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=F64)
    ro = torch.tensor([[-0.5, -0.5], [0.5, 0.5]], dtype=F64) * torch.log(torch.tensor(4.0, dtype=F64))  # geo = 2, 1/2
    assert rollout_correction_mask(old, ro * 0.99, torch.ones(2, 2, dtype=torch.bool), cap=2.0).all()
    assert not rollout_correction_mask(old, ro * 1.01, torch.ones(2, 2, dtype=torch.bool), cap=2.0).any()


@pytest.mark.parametrize("host_copies", [False, True])
@pytest.mark.parametrize("variant", ["clip", "gspo"])
def test_seq_mean_leaves_out_masked_sequences(host_copies, variant):
    """seq-mean over the sequences with a trained token, the last one wholly masked out (its ids -1 there: the
    host copies' largest id then bounds the segment count above the masked ones'), one partly masked. With host
    copies (a GPU job's trainer) nothing is read from the device; the value and gradient are the transcription's."""
    lo, hi = 0.2, 0.28
    lengths = (2, 3, 1, 4)
    logp, old, adv_seq, *_ = _data(11, lengths)
    keep = [torch.tensor([True, True]), torch.tensor([True, False, True]), torch.tensor([True]), torch.zeros(4, dtype=torch.bool)]
    leaves = _leaves(logp)
    terms = []
    for lp, od, a, k in zip(leaves, old, adv_seq, keep):
        if not k.any():
            terms.append(0.0 * lp.sum())  # in the graph, without a share of the loss
        else:
            if variant == "gspo":
                s_i = torch.exp((lp[k] - od[k]).mean())
                terms.append(torch.minimum(s_i * a, torch.clamp(s_i, 1 - lo, 1 + hi) * a))
            else:
                terms.append(ppo_token_terms(lp[k], od[k], a, lo, hi).mean())
    expected = -sum(terms) / sum(bool(k.any()) for k in keep)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq_ids[-4:] = -1
    mask, a = torch.cat(keep), adv_seq[seq_ids.clamp_min(0)]
    host = [seq_ids, a, mask]
    ins = [keep_host_copy(t.clone(), t) for t in host] if host_copies else [t.clone() for t in host]
    leaf = torch.cat(logp).clone().requires_grad_()
    with HostReads(host=host) as reads:
        out = policy_loss(leaf, torch.cat(old), ins[1], ins[2], seq_ids=ins[0], clip_ratio_low=lo, clip_ratio_high=hi,
                          loss_agg="seq-mean", variant=variant)
    if host_copies:
        assert reads.total == 0, reads.report()
    out.loss.backward()
    _check("packed", expected, _grads(expected, leaves), out, list(torch.split(leaf.grad, list(lengths))))
