"""PPO's algorithms against plain transcriptions of the papers' equations written here:

- GAE (Schulman et al. 2016, eq. 16): A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t
  with V after the last token 0, returns R_t = A_t + V_t — as an explicit sum (not the recursion the code
  uses), per sequence, for the padded [B, T] layout (right padding) and the packed [N] layout (seq_ids);
- PPO-RLHF's token rewards (Stiennon et al. 2020; Ouyang et al. 2022): r_t = -beta (log pi_old - log pi_ref)
  + [t = T] score;
- the clipped value loss (PPO2 / OpenAI baselines): 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2),
  values and gradients, token-mean over a padded mask and seq-mean over a packed layout;
- the critic's `prepare`: token rewards -> GAE -> whitening over the step's tokens (unbiased std).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, gae_advantages, needs_critic
from megatron_vlm.rl.algorithms.value_losses import VALUE_LOSSES, clipped_value_loss
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.rewards import token_rewards
from tests.fixtures.rl_config import rl_config


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Schulman et al. 2016: the advantage as the discounted sum of TD residuals, in Python floats."""
    T = len(rewards)
    v_next = [values[t + 1] if t + 1 < T else 0.0 for t in range(T)]
    delta = [rewards[t] + gamma * v_next[t] - values[t] for t in range(T)]
    adv = [sum((gamma * lam) ** k * delta[t + k] for k in range(T - t)) for t in range(T)]
    return adv, [a + v for a, v in zip(adv, values)]


def _sequences(seed: int, lengths: list[int]) -> list[tuple[list[float], list[float]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g, dtype=torch.float64).tolist(), torch.randn(n, generator=g, dtype=torch.float64).tolist())
            for n in lengths]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_padded_matches_the_paper(gamma, lam):
    seqs = _sequences(0, [5, 1, 3, 7])
    T = max(len(r) for r, _ in seqs)
    r = torch.zeros(len(seqs), T, dtype=torch.float64)
    v = torch.full((len(seqs), T), 123.0, dtype=torch.float64)  # padding values must not leak in
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (ri, vi) in enumerate(seqs):
        r[i, :len(ri)], v[i, :len(vi)] = torch.tensor(ri, dtype=torch.float64), torch.tensor(vi, dtype=torch.float64)
        mask[i, :len(ri)] = True
    adv, ret = gae_advantages(r, v, mask, gamma=gamma, lam=lam)
    assert adv.dtype == torch.float64
    for i, (ri, vi) in enumerate(seqs):
        a_ref, r_ref = gae_reference(ri, vi, gamma, lam)
        n = len(ri)
        torch.testing.assert_close(adv[i, :n], torch.tensor(a_ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[i, :n], torch.tensor(r_ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert bool((adv[i, n:] == 0).all()) and bool((ret[i, n:] == 0).all())


def test_gae_packed_matches_the_paper_and_the_padded_layout():
    seqs = _sequences(1, [4, 2, 6, 1])
    r = torch.tensor([x for ri, _ in seqs for x in ri], dtype=torch.float64)
    v = torch.tensor([x for _, vi in seqs for x in vi], dtype=torch.float64)
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(ri) for ri, _ in seqs]))
    adv, ret = gae_advantages(r, v, torch.ones_like(r, dtype=torch.bool), gamma=0.97, lam=0.9, seq_ids=seq_ids)
    a_ref = [a for ri, vi in seqs for a in gae_reference(ri, vi, 0.97, 0.9)[0]]
    r_ref = [x for ri, vi in seqs for x in gae_reference(ri, vi, 0.97, 0.9)[1]]
    torch.testing.assert_close(adv, torch.tensor(a_ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(r_ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # float32 input: float32 output, the same numbers to float32 precision
    adv32, _ = gae_advantages(r.float(), v.float(), torch.ones_like(r, dtype=torch.bool), gamma=0.97, lam=0.9, seq_ids=seq_ids)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv, rtol=1e-5, atol=1e-5)


def test_gae_skips_masked_positions_inside_a_sequence():
    """A masked position (e.g. a tool's tokens) is left out: the result equals GAE over the kept tokens alone."""
    ri, vi = _sequences(2, [6])[0]
    keep = [True, True, False, True, False, True]
    adv, ret = gae_advantages(torch.tensor([ri], dtype=torch.float64), torch.tensor([vi], dtype=torch.float64),
                              torch.tensor([keep]), gamma=0.95, lam=0.9)
    kr = [x for x, k in zip(ri, keep) if k]
    kv = [x for x, k in zip(vi, keep) if k]
    a_ref, r_ref = gae_reference(kr, kv, 0.95, 0.9)
    torch.testing.assert_close(adv[0, torch.tensor(keep)], torch.tensor(a_ref, dtype=adv.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[0, torch.tensor(keep)], torch.tensor(r_ref, dtype=adv.dtype), rtol=1e-12, atol=1e-12)
    assert bool((adv[0, ~torch.tensor(keep)] == 0).all())


def test_gae_refuses_bad_inputs():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="seq_ids"):
        gae_advantages(x, x, torch.ones(3, dtype=torch.bool), gamma=1.0, lam=0.9)
    with pytest.raises(ValueError, match="non-decreasing"):
        gae_advantages(x, x, torch.ones(3, dtype=torch.bool), gamma=1.0, lam=0.9, seq_ids=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(x[None], x[None], torch.ones(1, 3, dtype=torch.bool), gamma=1.5, lam=0.9)


def test_gae_is_registered_as_a_token_estimator():
    est = ADVANTAGE_ESTIMATORS.get("gae")
    assert est.fn is None and est.token_fn is gae_advantages and needs_critic("gae")
    assert not needs_critic("grpo") and not needs_critic("nope")
    assert "clipped" in VALUE_LOSSES and VALUE_LOSSES.get("clipped") is clipped_value_loss


def test_token_rewards_are_ppo_rlhf():
    old = torch.tensor([-1.0, -0.5, -2.0])
    ref = torch.tensor([-1.5, -0.5, -1.0])
    r, kl = token_rewards(0.7, 3, old_logp=old, ref_logp=ref, kl_coef=0.1, kl_estimator="k1")
    expect = [-0.1 * (-1.0 + 1.5), -0.1 * 0.0, -0.1 * (-2.0 + 1.0) + 0.7]
    torch.testing.assert_close(r, torch.tensor(expect), rtol=0, atol=1e-7)
    assert kl is not None
    r, kl = token_rewards(1.0, 2)  # no reference: the score on the last token only
    assert r.tolist() == [0.0, 1.0] and kl is None
    with pytest.raises(ValueError, match="ref_logp"):
        token_rewards(1.0, 2, kl_coef=0.1)


def value_loss_reference(v, v_old, ret, eps):
    """PPO2 (OpenAI baselines `ppo2/model.py`): vf_loss = .5 * max(vf_losses1, vf_losses2) per token."""
    v_clipped = v_old + torch.clamp(v - v_old, -eps, eps)
    return 0.5 * torch.max(torch.square(v - ret), torch.square(v_clipped - ret))


def test_clipped_value_loss_padded_values_and_gradients():
    g = torch.Generator().manual_seed(3)
    v_old = torch.randn(3, 6, generator=g, dtype=torch.float64)
    ret = torch.randn(3, 6, generator=g, dtype=torch.float64)
    v0 = v_old + 0.5 * torch.randn(3, 6, generator=g, dtype=torch.float64)  # some inside the clip range, some out
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    v = v0.clone().requires_grad_(True)
    loss, metrics = clipped_value_loss(v, v_old, ret, mask, clip_range=0.2, loss_agg="token-mean")
    loss.backward()
    v_ref = v0.clone().requires_grad_(True)
    per = value_loss_reference(v_ref, v_old, ret, 0.2)
    ref = (per * mask).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-12, atol=1e-12)
    # the gradient in closed form: (V - R) where the unclipped term is the max, 0 where the clipped one is and
    # V is outside [V_old - eps, V_old + eps], each divided by the token count
    unclipped = torch.square(v0 - ret) >= torch.square(v_old + (v0 - v_old).clamp(-0.2, 0.2) - ret)
    inside = (v0 - v_old).abs() < 0.2
    closed = torch.where(unclipped | inside, v0 - ret, torch.zeros_like(v0)) * mask / mask.sum()
    torch.testing.assert_close(v.grad, closed, rtol=1e-12, atol=1e-12)
    assert 0 < float(metrics["vf_clip_frac"]) < 1  # both branches occur in this batch


def test_clipped_value_loss_packed_seq_mean():
    g = torch.Generator().manual_seed(4)
    lengths = [3, 1, 5]
    n = sum(lengths)
    v_old, ret = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    v0 = v_old + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    v = v0.clone().requires_grad_(True)
    loss, _ = clipped_value_loss(v, v_old, ret, torch.ones(n, dtype=torch.bool), clip_range=0.1, loss_agg="seq-mean",
                                 seq_ids=seq_ids, normalizer=5.0)
    loss.backward()
    v_ref = v0.clone().requires_grad_(True)
    per = value_loss_reference(v_ref, v_old, ret, 0.1)
    ref = sum(chunk.mean() for chunk in torch.split(per, lengths)) / 5.0  # seq-mean with the mini-batch's normaliser
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-12, atol=1e-12)


def test_value_clip_zero_is_the_plain_squared_error():
    v = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss, m = clipped_value_loss(v, torch.zeros(3), torch.tensor([0.0, 0.0, 1.0]), torch.ones(3, dtype=torch.bool),
                                 clip_range=None, loss_agg="token-mean")
    assert math.isclose(float(loss.detach()), 0.5 * (1 + 4 + 4) / 3, rel_tol=1e-6) and float(m["vf_clip_frac"]) == 0.0


class _FixedValues(torch.nn.Module):
    """A stand-in value model: the values each sample was given, concatenated (the pack's layout)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, batch):
        return torch.cat([s._v for s in batch["group"]]) + 0 * self.w


def test_critic_prepare_is_rewards_then_gae_then_whitening():
    from megatron_vlm.rl.critic.ppo_critic import Critic
    from megatron_vlm.rl.data_shards import DataShards

    rl = rl_config(advantage="gae", kl_coef=0.05, kl_estimator="k1", advantages__gamma=0.99, advantages__lam=0.9)
    g = torch.Generator().manual_seed(5)
    samples = []
    for n, score in ((3, 1.0), (1, 0.0), (4, 0.5)):
        s = TrainSample(prompt=None, response_ids=torch.zeros(n, dtype=torch.long), behav_logp=torch.zeros(n),  # type: ignore[arg-type]
                        advantage=0.0, old_logp=-torch.rand(n, generator=g), ref_logp=-torch.rand(n, generator=g),
                        score=score)
        s._v = torch.randn(n, generator=g)  # type: ignore[attr-defined]
        samples.append(s)
    model = _FixedValues()
    critic = Critic(model, torch.optim.AdamW(model.parameters()), rl,  # type: ignore[arg-type]
                    shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=1.0, seed=0)
    metrics = critic.prepare(samples, lambda ss: [list(ss)], lambda grp: {"group": grp})
    raw = []
    for s in samples:
        rewards = [-0.05 * (o - r) for o, r in zip(s.old_logp.tolist(), s.ref_logp.tolist())]
        rewards[-1] += s.score
        a, ret = gae_reference(rewards, s._v.tolist(), 0.99, 0.9)
        torch.testing.assert_close(s.returns.double(), torch.tensor(ret, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.old_values, s._v)
        raw.append(a)
    flat = torch.tensor([x for a in raw for x in a], dtype=torch.float64)
    whitened = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + 1e-8)
    got = torch.cat([s.token_advantages for s in samples]).double()
    torch.testing.assert_close(got, whitened, rtol=1e-5, atol=1e-5)
    assert abs(metrics["advantage/mean"]) < 1e-6 and abs(metrics["advantage/std"] - 1.0) < 1e-4
    # advantages.normalize_std = false: GAE as it is
    rl.advantages.normalize_std = False
    critic = Critic(model, torch.optim.AdamW(model.parameters()), rl,  # type: ignore[arg-type]
                    shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=1.0, seed=0)
    critic.prepare(samples, lambda ss: [list(ss)], lambda grp: {"group": grp})
    torch.testing.assert_close(torch.cat([s.token_advantages for s in samples]).double(), flat, rtol=1e-5, atol=1e-5)


def test_critic_value_loss_is_the_mean_over_the_updates_that_ran():
    """`critic/value_loss` is the mean of the critic updates' losses: a mini-batch without a token anywhere (its
    samples all dropped) runs no update and does not count, as for the policy's loss. Two samples in four
    mini-batches run the same two updates as in two mini-batches (the same shuffle), so they report the same."""
    from megatron_vlm.rl.critic.ppo_critic import Critic
    from megatron_vlm.rl.data_shards import DataShards
    from tests.unit.rl.test_ppo_critic_ranks import _LinearValues, _samples

    def value_loss(mini_batches):
        samples = _samples()[:2]
        model = _LinearValues()
        critic = Critic(model, torch.optim.SGD(model.parameters(), lr=0.5), rl_config(advantage="gae",  # type: ignore[arg-type]
                        mini_batches_per_step=mini_batches), shards=DataShards(rank=0, world=1, copies=1,
                        device=torch.device("cpu")), max_grad_norm=0.0, seed=0)
        packs, to_batch = (lambda ss: [list(ss)] if ss else []), (lambda grp: {"group": grp})
        critic.prepare(samples, packs, to_batch)
        return critic.update(0, samples, packs, to_batch)["critic/value_loss"]

    assert value_loss(2) > 0
    assert value_loss(4) == pytest.approx(value_loss(2), rel=1e-6)
