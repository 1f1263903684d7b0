"""`rl.advantages.kl_in_reward`: where REINFORCE++'s KL penalty goes (verl's `algorithm.use_kl_in_reward`).

- `reinforce_plus_plus_baseline` with `kl_in_reward = true`: the advantages equal the equations transcribed here in
  plain torch (not produced by the code under test): token reward r_t = -beta KL_t, plus the outcome reward minus its
  group's mean at the last token, returns G_t = sum_{s >= t} r_s, normalised with the mean and unbiased variance of
  every response token of the batch; both KL estimators, with and without the std division;
- `reinforce_plus_plus` with `kl_in_reward = false`: the returns of the outcome reward alone (the KL in the loss);
- the update takes the KL out of the loss exactly where it went into the reward (a tiny GRPO loop, so that the
  old and reference log-probs differ);
- the key is refused, exit 2 naming it, where it cannot do what it says: a group estimator (one advantage per
  completion, no per-token reward), `gae` with false (the critic's rewards always hold it), `loss.kl_coef = 0`.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_vlm.rl.algorithms.advantage_estimators import kl_in_reward
from megatron_vlm.rl.batch_advantages import BatchAdvantages
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.bigram_loop import prompts
from tests.unit.rl.test_reinforce_plus_plus import BASE, GRPO_DEMO, ONE, REPO, RPP, _batch, _loop, _samples


def _kl(old: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return old - ref
    d = ref - old
    return torch.exp(d) - d - 1


def _reference(rewards, olds, refs, *, group_size: int, beta: float, gamma: float, kl_estimator: str,
               baseline: bool, whiten: bool) -> list[torch.Tensor]:
    """Per-token advantages (float64), written out: r_t = -beta KL_t + [t = last] (r - group mean if baseline)."""
    raw = []
    for i, (old, ref) in enumerate(zip(olds, refs)):
        L = old.numel()
        first = (i // group_size) * group_size
        group = [float(x) for x in rewards[first:first + group_size]]
        score = float(rewards[i]) - (sum(group) / len(group) if baseline else 0.0)
        r = [-beta * float(k) for k in _kl(old.double(), ref.double(), kl_estimator)]
        r[L - 1] += score
        raw.append(torch.tensor([sum(gamma ** (s - t) * r[s] for s in range(t, L)) for t in range(L)],
                                dtype=torch.float64))
    a = torch.cat(raw)
    mean, var = a.sum() / a.numel(), ((a - a.sum() / a.numel()) ** 2).sum() / (a.numel() - 1)
    return [(g - mean) / torch.sqrt(var + 1e-8) if whiten else g - mean for g in raw]


@pytest.mark.parametrize("kl_estimator, whiten, group_size", [("k1", None, 3), ("k3", None, 4), ("k1", False, 2)])
def test_the_baseline_variant_with_the_kl_in_the_reward(kl_estimator, whiten, group_size):
    rewards, olds, refs = _batch(7, 12)
    rl = rl_config(validate=True, advantage=BASE, group_size=group_size, loss__kl_coef=0.2,
                   loss__kl_estimator=kl_estimator, advantages__normalize_std=whiten, advantages__kl_in_reward=True)
    samples = _samples(rewards, olds, refs, estimator=BASE, group_size=group_size)
    metrics = BatchAdvantages(rl, ONE).prepare(samples)
    want = _reference(rewards, olds, refs, group_size=group_size, beta=0.2, gamma=1.0, kl_estimator=kl_estimator,
                      baseline=True, whiten=whiten is not False)
    for s, w in zip(samples, want):
        torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-5, atol=1e-6)
    kl = torch.cat([_kl(o.double(), r.double(), kl_estimator) for o, r in zip(olds, refs)])
    assert metrics["advantage/kl_in_reward"] == pytest.approx(float(kl.mean()), rel=1e-5)
    # without the key the KL is not in the advantages (it stays in the loss)
    plain = _samples(rewards, olds, refs, estimator=BASE, group_size=group_size)
    BatchAdvantages(rl_config(validate=True, advantage=BASE, group_size=group_size, loss__kl_coef=0.2,
                              loss__kl_estimator=kl_estimator, advantages__normalize_std=whiten), ONE).prepare(plain)
    assert not torch.allclose(plain[0].token_advantages, samples[0].token_advantages, atol=1e-3)


def test_reinforce_pp_with_the_kl_in_the_loss():
    rewards, olds, refs = _batch(8, 10)
    rl = rl_config(validate=True, advantage=RPP, group_size=1, loss__kl_coef=0.2, advantages__gamma=0.9,
                   advantages__kl_in_reward=False)
    samples = _samples(rewards, olds, refs, estimator=RPP, group_size=1)
    metrics = BatchAdvantages(rl, ONE).prepare(samples)
    want = _reference(rewards, olds, refs, group_size=1, beta=0.0, gamma=0.9, kl_estimator="k1", baseline=False,
                      whiten=True)
    for s, w in zip(samples, want):
        torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-5, atol=1e-6)
    assert "advantage/kl_in_reward" not in metrics


def test_the_resolved_setting():
    assert kl_in_reward(RPP) and kl_in_reward("gae") and not kl_in_reward(BASE) and not kl_in_reward("grpo")
    assert kl_in_reward(BASE, True) and not kl_in_reward(RPP, False) and kl_in_reward(RPP, True)


@pytest.mark.parametrize("estimator, setting, in_loss", [(BASE, True, 0.0), (BASE, None, 0.05), (RPP, False, 0.05),
                                                         (RPP, None, 0.0)])
def test_the_update_takes_the_kl_out_of_the_loss_where_it_is_in_the_reward(estimator, setting, in_loss, monkeypatch):
    import tests.unit.rl.test_reinforce_plus_plus as rpp

    real = rpp.rl_config
    monkeypatch.setattr(rpp, "rl_config", lambda **kw: real(**kw, advantages__kl_in_reward=setting))
    group_size = 2 if estimator == BASE else 1
    grpo, _, seen = _loop(estimator, group_size)
    assert grpo.policy.loss_spec.kl_coef == in_loss
    pool = prompts(8 // group_size)
    for step in range(3):
        row = grpo.run(step, pool, prompt_pool=pool)
    samples = seen["samples"]
    assert any(float((s.old_logp - s.ref_logp).abs().max()) > 1e-3 for s in samples)  # the policy has moved
    rewards = torch.tensor([s.score for s in samples])
    want = _reference(rewards, [s.old_logp for s in samples], [s.ref_logp for s in samples], group_size=group_size,
                      beta=0.05 if in_loss == 0.0 else 0.0, gamma=1.0, kl_estimator="k1", baseline=estimator == BASE,
                      whiten=True)
    for s, w in zip(samples, want):
        torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-4, atol=1e-5)
    assert ("advantage/kl_in_reward" in row) == (in_loss == 0.0)


def test_the_loader_refuses_it_where_it_cannot_do_what_it_says():
    from megatron_vlm.config import load_config
    from megatron_vlm.config.loader import ConfigError

    kl = "rl.loss.kl_coef=0.05"
    ok = load_config(GRPO_DEMO, [f'rl.advantage="{BASE}"', kl, "rl.advantages.kl_in_reward=true"])
    assert ok.rl.advantages.kl_in_reward is True
    load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', kl, "rl.advantages.kl_in_reward=false"])
    load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', kl, "rl.advantages.kl_in_reward=true"])
    load_config(GRPO_DEMO, ['rl.advantage="grpo"', kl, "rl.advantages.kl_in_reward=false"])
    for over, why in (([f'rl.advantage="{BASE}"', "rl.advantages.kl_in_reward=true"], "loss.kl_coef = 0"),
                      ([f'rl.advantage="{RPP}"', "rl.advantages.kl_in_reward=false"], "loss.kl_coef = 0"),
                      (['rl.advantage="grpo"', kl, "rl.advantages.kl_in_reward=true"], "one advantage per completion"),
                      (['rl.advantage="rloo"', kl, "rl.advantages.kl_in_reward=true"], "one advantage per completion")):
        with pytest.raises(ConfigError, match=r"^rl\.advantages\.kl_in_reward: ") as e:
            load_config(GRPO_DEMO, over)
        assert why in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"^advantages\.kl_in_reward: .*'gae'"):
        rl_config(validate=True, advantage="gae", loss__kl_coef=0.05, advantages__kl_in_reward=False)


@pytest.mark.heavy  # a subprocess (~10 s); the loader test above covers the ConfigError it exits 2 with
def test_the_entry_point_exits_2_naming_the_key():
    r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(GRPO_DEMO), "--check",
                        "--set", 'rl.advantage="grpo"', "--set", "rl.loss.kl_coef=0.05",
                        "--set", "rl.advantages.kl_in_reward=true"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rl.advantages.kl_in_reward: " in r.stderr and "Traceback" not in r.stderr


def test_gspo_is_refused_where_the_kl_in_the_reward_makes_the_advantages_per_token():
    """`policy_loss = "gspo"` takes one advantage per sequence. `reinforce_plus_plus_baseline` gives one (its centred
    reward on every token) unless `kl_in_reward = true` puts -kl_coef x KL_t into per-token rewards: each token's
    advantage is then its own return, different along the sequence, and the loss raised a ValueError at the first
    update, after the step's rollout. Refused by the loader instead (exit 2 naming the key); the baseline variant with
    the KL in the loss keeps gspo."""
    from megatron_vlm.config import load_config
    from megatron_vlm.config.loader import ConfigError

    kl = "rl.loss.kl_coef=0.05"
    rl = rl_config(validate=True, advantage=BASE, group_size=3, loss__kl_coef=0.05, loss__kl_estimator="k1",
                   advantages__kl_in_reward=True)
    rewards, olds, refs = _batch(5, 6)
    samples = _samples(rewards, olds, refs, estimator=BASE, group_size=3)
    BatchAdvantages(rl, ONE).prepare(samples)
    assert any(float(s.token_advantages.max() - s.token_advantages.min()) > 1e-3  # type: ignore[union-attr]
               for s in samples)  # the advantages vary within a sequence: gspo cannot take them
    with pytest.raises(ConfigError, match=r"^rl\.policy_loss: 'gspo' .*kl_in_reward"):
        load_config(GRPO_DEMO, [f'rl.advantage="{BASE}"', kl, "rl.advantages.kl_in_reward=true", 'rl.policy_loss="gspo"'])
    ok = load_config(GRPO_DEMO, [f'rl.advantage="{BASE}"', kl, 'rl.policy_loss="gspo"'])
    assert ok.rl.policy_loss == "gspo"


@pytest.mark.parametrize("estimator, group_size", [(RPP, 1), (BASE, 2)])
def test_asynchronous_kl_in_the_reward_reads_the_policy_that_generated(estimator, group_size):
    """Asynchronous GRPO with stale samples (max_head_offpolicyness > 0): `old_logp` is the proximal policy (the
    trainer's weights before the update) once recomputed (several mini-batches), but still the behaviour log-probs
    when a single update takes the proximal ones from its own forward. KL_t in the reward is the KL of the policy
    that generated the samples (REINFORCE++'s pi_old, OpenRLHF's experience-time log-probs): the behaviour log-probs
    in both cases, so the advantages do not depend on how many mini-batches the step has."""
    rewards, behavs, refs = _batch(11, 6)
    proximal = [b + torch.linspace(-0.4, 0.3, b.numel()) for b in behavs]  # a newer policy than the one that sampled
    rl = rl_config(validate=True, advantage=estimator, group_size=group_size, loss__kl_coef=0.2,
                   loss__kl_estimator="k1", advantages__kl_in_reward=True, allocation="rollout:1+train:1",
                   asynchronous__max_head_offpolicyness=2)
    want = _reference(rewards, behavs, refs, group_size=group_size, beta=0.2, gamma=1.0, kl_estimator="k1",
                      baseline=estimator == BASE, whiten=True)
    kl = torch.cat([_kl(b.double(), r.double(), "k1") for b, r in zip(behavs, refs)])
    for olds in (proximal, behavs):  # recomputed (mini_batches_per_step > 1) / from the update's forward (one update)
        samples = _samples(rewards, olds, refs, estimator=estimator, group_size=group_size)
        for s, b in zip(samples, behavs):
            s.behav_logp = b.clone()
        metrics = BatchAdvantages(rl, ONE).prepare(samples)
        for s, w in zip(samples, want):
            torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-5, atol=1e-6)
        assert metrics["advantage/kl_in_reward"] == pytest.approx(float(kl.mean()), rel=1e-5)
