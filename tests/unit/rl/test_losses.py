"""PPO / GRPO policy loss against a hand-written Python-float reference: both clipping branches,
gradients (d loss / d logp derived by hand), token-mean vs seq-mean, padded vs packed layouts,
k1 / k3 KL, the decoupled behaviour-weighted variant, and metrics."""
import math

import pytest
import torch

from megatron_vlm.rl.losses import aggregate_loss, kl_penalty, policy_loss

LOW, HIGH = 0.2, 0.28


def _ref_token(lp, old, a, low=LOW, high=HIGH, w=1.0):
    """(loss, d loss / d lp) of one token, written out by branch."""
    r = math.exp(lp - old)
    unclipped = -a * r
    clipped = -a * min(max(r, 1 - low), 1 + high)
    if clipped > unclipped:  # the clipped branch is active: constant in lp
        return w * clipped, 0.0
    return w * unclipped, -w * a * r


def _ref_kl(lp, ref, est):
    if est == "k1":
        return lp - ref, 1.0
    d = ref - lp
    return math.exp(d) - d - 1, 1 - math.exp(d)  # d/dlp of exp(ref-lp) - (ref-lp) - 1


def _ref_loss(logp, old, adv, mask, agg, kl_coef=0.0, ref=None, est="k3", behav=None, cap=None):
    """Loss and gradient over a [B, T] layout with per-sequence advantages (Python floats)."""
    B, T = len(logp), len(logp[0])
    grads = [[0.0] * T for _ in range(B)]
    n_tok = sum(sum(row) for row in mask)
    n_seq = sum(1 for row in mask if any(row))
    total = 0.0
    for b in range(B):
        cnt = sum(mask[b])
        for t in range(T):
            if not mask[b][t]:
                continue
            w = 1.0
            if behav is not None:
                w = math.exp(old[b][t] - behav[b][t])
                if cap is not None and w > cap:
                    w = 0.0
            loss, g = _ref_token(logp[b][t], old[b][t], adv[b], w=w)
            if kl_coef:
                kl, gk = _ref_kl(logp[b][t], ref[b][t], est)
                loss, g = loss + kl_coef * kl, g + kl_coef * gk
            scale = 1.0 / n_tok if agg == "token-mean" else 1.0 / (cnt * n_seq)
            total += loss * scale
            grads[b][t] = g * scale
    return total, grads


def _case():
    # ratios chosen to exercise every branch: A>0 & r>1+high (clipped), A>0 & r<1-low (unclipped),
    # A<0 & r<1-low (clipped), A<0 & r>1+high (unclipped), r inside the range
    old = [[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.2, -2.2, -0.9, -4.0], [-1.1, -0.3, -2.5, -1.9, -0.8]]
    shifts = [[0.5, -0.4, 0.05, 0.0, 0.3], [-0.5, 0.4, 0.1, -0.3, 0.6], [0.0, 0.35, -0.3, 0.2, -0.1]]
    logp = [[o + s for o, s in zip(orow, srow)] for orow, srow in zip(old, shifts)]
    adv = [1.3, -0.8, 0.6]
    mask = [[True, True, True, True, False], [False, True, True, True, True], [True, True, False, False, False]]
    ref = [[o - 0.3 + 0.1 * t for t, o in enumerate(orow)] for orow in old]
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("kl", [None, "k1", "k3"])
def test_loss_and_grad_match_reference(agg, kl):
    logp, old, adv, mask, ref = _case()
    kl_coef = 0.05 if kl else 0.0
    exp_loss, exp_grad = _ref_loss(logp, old, adv, mask, agg, kl_coef=kl_coef, ref=ref, est=kl or "k3")
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), torch.tensor(mask),
        clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg=agg,
        ref_logp=torch.tensor(ref, dtype=torch.float64) if kl else None, kl_coef=kl_coef, kl_estimator=kl or "k3",
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(exp_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(exp_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    if kl is None:  # clipped tokens (high: A>0, r=e^0.5; low: A<0, r=e^-0.3) get no gradient
        assert lp.grad[0, 0] == 0 and lp.grad[1, 3] == 0
        assert lp.grad[0, 1] != 0 and lp.grad[1, 1] != 0  # unclipped: A>0 & r<1-low, A<0 & r>1+high


def test_clip_metrics_count_each_branch():
    logp, old, adv, mask, _ = _case()
    out = policy_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask),
                      clip_ratio_low=LOW, clip_ratio_high=HIGH)
    high = low = 0
    n = 0
    for b in range(3):
        for t in range(5):
            if not mask[b][t]:
                continue
            n += 1
            r = math.exp(logp[b][t] - old[b][t])
            high += adv[b] > 0 and r > 1 + HIGH
            low += adv[b] < 0 and r < 1 - LOW
    assert high >= 1 and low >= 1
    assert out.metrics["clip_frac_high"].item() == pytest.approx(high / n)
    assert out.metrics["clip_frac_low"].item() == pytest.approx(low / n)
    assert out.metrics["clip_frac"].item() == pytest.approx((high + low) / n)
    assert out.num_tokens.item() == n


def test_on_policy_gradient_is_minus_advantage():
    # logp == old_logp (first PPO step): ratio 1, loss gradient -A / n_tokens for every token
    lp = torch.randn(2, 3, requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    policy_loss(lp, lp.detach(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2).loss.backward()
    torch.testing.assert_close(lp.grad, (-adv[:, None] / 6).expand(2, 3))


def test_packed_layout_equals_padded():
    logp, old, adv, mask, _ = _case()
    lp, od, m = torch.tensor(logp), torch.tensor(old), torch.tensor(mask)
    seq = torch.arange(3)[:, None].expand(3, 5)

    def flat(x):
        return x.reshape(-1)

    for agg in ("token-mean", "seq-mean"):
        padded = policy_loss(lp, od, torch.tensor(adv), m, clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg=agg).loss
        packed = policy_loss(flat(lp), flat(od), torch.tensor(adv)[flat(seq)], flat(m), clip_ratio_low=LOW,
                             clip_ratio_high=HIGH, loss_agg=agg, seq_ids=flat(seq)).loss
        torch.testing.assert_close(padded, packed)
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(flat(lp), flat(od), torch.zeros(15), flat(m), clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg="seq-mean")


def test_global_normalizer_makes_micro_batches_add_up():
    # splitting a batch into micro-batches with the global token count as normaliser sums to the full loss
    logp, old, adv, mask, _ = _case()
    lp, od, a, m = torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask)
    full = policy_loss(lp, od, a, m, clip_ratio_low=LOW, clip_ratio_high=HIGH).loss
    n = m.sum()
    parts = sum(policy_loss(lp[i:i + 1], od[i:i + 1], a[i:i + 1], m[i:i + 1], clip_ratio_low=LOW,
                            clip_ratio_high=HIGH, normalizer=n).loss for i in range(3))
    torch.testing.assert_close(full, parts)


def test_decoupled_loss_weights_and_caps():
    logp, old, adv, mask, _ = _case()
    behav = [[o + d for o, d in zip(row, [0.0, -0.2, 0.3, -2.0, 0.1])] for row in old]  # w = exp(old - behav)
    cap = 5.0
    exp_loss, exp_grad = _ref_loss(logp, old, adv, mask, "token-mean", behav=behav, cap=cap)
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), torch.tensor(mask),
                      clip_ratio_low=LOW, clip_ratio_high=HIGH, behav_logp=torch.tensor(behav, dtype=torch.float64),
                      behav_imp_weight_cap=cap)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(exp_loss, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(exp_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert out.metrics["behav_capped_frac"].item() > 0  # exp(2) > 5 for column 3
    # behaviour == proximal reduces to the synchronous loss
    sync = policy_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_ratio_low=LOW, clip_ratio_high=HIGH)
    dec = policy_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_ratio_low=LOW,
                      clip_ratio_high=HIGH, behav_logp=torch.tensor(old))
    torch.testing.assert_close(sync.loss, dec.loss)


def test_kl_estimators_and_metrics():
    lp = torch.tensor([-1.0, -2.0, -0.1])
    ref = torch.tensor([-1.5, -1.0, -0.1])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    d = ref - lp
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    ent = torch.tensor([[0.5, 1.5], [2.0, 9.0]])
    m = torch.tensor([[True, True], [True, False]])
    out = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), m, clip_ratio_low=0.2, clip_ratio_high=0.2,
                      ref_logp=torch.zeros(2, 2), entropy=ent)
    assert out.metrics["entropy"].item() == pytest.approx(4.0 / 3)
    assert out.metrics["kl"].item() == 0.0 and out.metrics["ratio_mean"].item() == 1.0


def test_seq_mean_weights_sequences_equally():
    per_tok = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True, True], [True, False, False, False]])
    assert aggregate_loss(per_tok, m, "seq-mean").item() == pytest.approx((1.0 + 4.0) / 2)
    assert aggregate_loss(per_tok, m, "token-mean").item() == pytest.approx(8.0 / 5)


def test_errors_name_the_argument():
    z = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(z, z, torch.zeros(2), m, clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(z, z, torch.zeros(2), m.float(), clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(z, z, torch.zeros(5), m, clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(z, z, "k2")
    with pytest.raises(ValueError, match="behav_imp_weight_cap"):
        policy_loss(z, z, torch.zeros(2), m, clip_ratio_low=0.2, clip_ratio_high=0.2, behav_imp_weight_cap=2.0)
