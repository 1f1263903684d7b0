"""The PPO critic's `prepare` takes the step's token rewards and GAE in one padded batch, against:

- a plain-torch transcription of GAE written here (Schulman et al. 2016: delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, returns A + V, V after the last token 0), one sample at a time in float64;
- the per-sample computation it replaced (`token_rewards` and the estimator on each sample alone), bit for bit;
- a count of the estimator's calls (one per step, of shape [samples, longest response]).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_ppo_gae_value_loss import _FixedValues  # a stand-in critic: the values each sample was given

from megatron_vlm.rl.algorithms.advantage_estimators import gae_advantages
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.critic.rewards import step_token_rewards, token_rewards
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.testing.host_reads import HostReads
from tests.fixtures.rl_config import rl_config

LENGTHS = [1, 300, 2, 1, 57, 5, 1]
GAMMA, LAM, KL = 0.99, 0.9, 0.05


def gae_transcribed(r: torch.Tensor, v: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's GAE, the paper's recursion from the last token back, float64."""
    r, v = r.double(), v.double()
    adv = torch.zeros_like(r)
    a_next, v_next = 0.0, 0.0
    for t in range(r.numel() - 1, -1, -1):
        delta = r[t] + gamma * v_next - v[t]
        adv[t] = delta + gamma * lam * a_next
        a_next, v_next = adv[t], v[t]
    return adv, adv + v


def _samples(lengths, seed=0, ref=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = TrainSample(prompt=None, response_ids=torch.zeros(n, dtype=torch.long), behav_logp=torch.zeros(n),  # type: ignore[arg-type]
                        advantage=0.0, old_logp=-3 * torch.rand(n, generator=g),
                        ref_logp=-3 * torch.rand(n, generator=g) if ref else None,
                        score=float(torch.randn((), generator=g)))
        s._v = torch.randn(n, generator=g)  # type: ignore[attr-defined]
        out.append(s)
    return out


def _critic(kl_estimator="k1", normalize_std=False, kl_coef=KL):
    rl = rl_config(advantage="gae", kl_coef=kl_coef, kl_estimator=kl_estimator, advantages__gamma=GAMMA,
                   advantages__lam=LAM)
    rl.advantages.normalize_std = normalize_std
    model = _FixedValues()
    return Critic(model, torch.optim.AdamW(model.parameters()), rl,  # type: ignore[arg-type]
                  shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=1.0, seed=0)


PACKS, TO_BATCH = (lambda ss: [list(ss)] if ss else []), (lambda grp: {"group": grp})


def test_the_step_s_gae_is_one_call_of_the_estimator(monkeypatch):
    """The GAE recursion over the positions is a Python loop of a few tensor ops per position (~10 us): a call per
    sample cost the step samples x response length of them (64 samples of 8k tokens: seconds of host time), one
    call of the padded batch only its longest response."""
    critic = _critic()
    calls = []
    real = critic.estimator.token_fn
    assert real is not None

    def counting(r, v, m, **kw):
        calls.append(tuple(r.shape))
        return real(r, v, m, **kw)

    critic.estimator = dataclasses.replace(critic.estimator, token_fn=counting)
    critic.prepare(_samples(LENGTHS), PACKS, TO_BATCH)
    assert calls == [(len(LENGTHS), max(LENGTHS))], calls


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_prepare_is_the_transcribed_gae_and_the_per_sample_computation(kl_estimator):
    """Advantages (normalize_std = false) and returns: bit for bit those of each sample alone (token_rewards, then
    the estimator on a [1, length] batch), and the transcription's to float32 rounding."""
    samples = _samples(LENGTHS, seed=1)
    _critic(kl_estimator).prepare(samples, PACKS, TO_BATCH)
    for s in samples:
        r, _ = token_rewards(s.score, s.response_length, old_logp=s.old_logp, ref_logp=s.ref_logp, kl_coef=KL,
                             kl_estimator=kl_estimator)
        adv, ret = gae_advantages(r[None], s._v[None], torch.ones(1, s.response_length, dtype=torch.bool),
                                  gamma=GAMMA, lam=LAM)
        assert s.token_advantages.dtype == s.returns.dtype == torch.float32
        assert torch.equal(s.token_advantages, adv[0]) and torch.equal(s.returns, ret[0])
        a_ref, r_ref = gae_transcribed(r, s._v, GAMMA, LAM)
        torch.testing.assert_close(s.token_advantages.double(), a_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.returns.double(), r_ref, rtol=1e-5, atol=1e-5)


def test_whitened_advantages_and_metrics_are_the_step_s():
    samples = _samples(LENGTHS, seed=2)
    metrics = _critic(normalize_std=None).prepare(samples, PACKS, TO_BATCH)
    raw, rets, vals, kl = [], [], [], 0.0
    for s in samples:
        r, k = token_rewards(s.score, s.response_length, old_logp=s.old_logp, ref_logp=s.ref_logp, kl_coef=KL)
        a, ret = gae_transcribed(r, s._v, GAMMA, LAM)
        raw.append(a), rets.append(ret), vals.append(s._v.double())
        kl += float(k.double().sum())  # type: ignore[union-attr]
    flat, ret, v = torch.cat(raw), torch.cat(rets), torch.cat(vals)
    whitened = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
    torch.testing.assert_close(torch.cat([s.token_advantages for s in samples]).double(), whitened, rtol=1e-4, atol=1e-4)
    n = flat.numel()
    assert metrics["critic/kl_in_reward"] == pytest.approx(kl / n, rel=1e-6)
    assert metrics["critic/returns_mean"] == pytest.approx(float(ret.mean()), rel=1e-5, abs=1e-6)
    assert metrics["critic/values_old_mean"] == pytest.approx(float(v.mean()), rel=1e-5, abs=1e-6)
    assert metrics["critic/explained_var"] == pytest.approx(1 - float((ret - v).var(unbiased=False) / ret.var(unbiased=False)),
                                                            rel=1e-4)
    assert metrics["advantage/min"] == pytest.approx(float(whitened.min()), rel=1e-4)
    assert metrics["advantage/max"] == pytest.approx(float(whitened.max()), rel=1e-4)


def test_prepare_without_samples_reports_nothing():
    assert _critic().prepare([], PACKS, TO_BATCH) == {}


def test_prepare_reads_the_device_once():
    """The values come to the host in one read after their pass; the rewards, GAE, whitening and the sums that
    follow are computed on those host copies and the samples' host log-probs (free reads)."""
    samples = _samples(LENGTHS, seed=3)
    reads = HostReads(host=[t for s in samples for t in (s.old_logp, s.ref_logp, s.response_ids)])
    with reads:
        _critic(normalize_std=None).prepare(samples, PACKS, TO_BATCH)
    assert reads.total == 1, reads.report()


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
@pytest.mark.parametrize("ref", ["all", "none", "some"])
def test_step_token_rewards_are_the_samples_token_rewards(kl_estimator, ref):
    samples = _samples(LENGTHS, seed=4, ref=ref != "none")
    if ref == "some":
        samples[1].ref_logp = None
    kl_coef = 0.0 if ref != "all" else KL
    got, kl_sum = step_token_rewards([s.score for s in samples], LENGTHS, old_logp=[s.old_logp for s in samples],
                                     ref_logp=[s.ref_logp for s in samples], kl_coef=kl_coef, kl_estimator=kl_estimator)
    parts = [token_rewards(s.score, s.response_length, old_logp=s.old_logp, ref_logp=s.ref_logp, kl_coef=kl_coef,
                           kl_estimator=kl_estimator) for s in samples]
    assert got.dtype == torch.float32 and torch.equal(got, torch.cat([r for r, _ in parts]))
    assert kl_sum == pytest.approx(sum(float(k.double().sum()) for _, k in parts if k is not None), rel=1e-12, abs=0)


def test_step_token_rewards_refuse_bad_inputs():
    samples = _samples([3, 2], seed=5)
    args = dict(old_logp=[s.old_logp for s in samples], ref_logp=[s.ref_logp for s in samples], kl_coef=KL)
    with pytest.raises(ValueError, match="need 3 entries"):
        step_token_rewards([0.0, 1.0], [3, 3], **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 1 token"):
        step_token_rewards([0.0, 1.0], [3, 0], **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per completion"):
        step_token_rewards([0.0], [3, 2], **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="required when kl_coef"):
        step_token_rewards([0.0, 1.0], [3, 2], old_logp=args["old_logp"], ref_logp=[None, None], kl_coef=KL)


def test_values_of_the_wrong_length_are_refused():
    samples = _samples([3, 2], seed=6)
    samples[1]._v = torch.zeros(3)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="entries for 5 response tokens"):
        _critic().prepare(samples, PACKS, TO_BATCH)


def test_values_misaligned_between_samples_are_refused_naming_the_sample(monkeypatch):
    """One sample with a value too many and the next with one too few add up to the step's token count: the batched
    GAE would take the first sample's extra value as the second's first and train every later token on a shifted
    value. Each sample's count is checked against its response length (shapes, no host read)."""
    samples = _samples([3, 2, 4], seed=7)
    critic = _critic()

    def misaligned(ss, packs, to_batch):
        for s, n in zip(ss, [3, 3, 3]):
            s.old_values = torch.zeros(n)

    monkeypatch.setattr(critic, "values", misaligned)
    with pytest.raises(ValueError, match=r"^old_values: sample 1 of the step has 3 values for its 2 response tokens"):
        critic.prepare(samples, PACKS, TO_BATCH)
