"""REINFORCE++ advantages (`rl.advantage = "reinforce_plus_plus"`) with GSPO's sequence loss (`rl.policy_loss = "gspo"`).

REINFORCE++ (Hu et al. 2025) gives token t of completion i the return G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s}
of the per-token rewards r_{i,t} = -beta KL_{i,t} + [t = last] R_i, whitened over every response token of the batch:
A_{i,t} = (G_{i,t} - mean) / sqrt(var + 1e-8). GSPO (Zheng et al. 2025) takes one advantage per sequence, with the
sequence ratio s_i = exp(1/|y_i| sum_t log(pi_theta(y_{i,t}) / pi_old(y_{i,t}))) clipped once per sequence:
l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)).

Without a discount (gamma unset or 1) and without the KL penalty in the rewards (loss.kl_coef = 0, or
advantages.kl_in_reward = false: the KL a loss term), G_{i,t} = R_i on every token, so A_{i,t} = A_i is one advantage
per sequence and the combination is defined. The loader refused it anyway; it is accepted now, and the loss of the
update equals the equations transcribed here in plain torch. A discount (gamma < 1) or the KL in every token's reward
makes the advantage vary along the sequence: still refused (exit 2), naming both keys.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.config.loader import ConfigError
from megatron_vlm.rl.advantages import compute_group_advantages
from megatron_vlm.rl.algorithms.policy_losses import PolicyLossSpec, compute_policy_loss
from megatron_vlm.rl.batch_advantages import BatchAdvantages
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.data_shards import DataShards
from tests.fixtures.rl_config import rl_config

REPO = Path(__file__).resolve().parents[3]
GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"  # loss.kl_coef = 0
RPP = "reinforce_plus_plus"
GSPO = ['rl.advantage="reinforce_plus_plus"', 'rl.policy_loss="gspo"']


@pytest.mark.parametrize("extra", [[], ["rl.advantages.gamma=1.0"],
                                   ["rl.loss.kl_coef=0.05", "rl.advantages.kl_in_reward=false"],
                                   ["rl.loss.kl_coef=0.05", "rl.advantages.kl_in_reward=false", "rl.batch.group_size=1"]])
def test_the_loader_accepts_gspo_where_reinforce_pp_gives_one_advantage_per_sequence(extra):
    cfg = load_config(GRPO_DEMO, GSPO + extra)
    assert cfg.rl.policy_loss == "gspo" and cfg.rl.advantage == RPP


def test_the_loader_refuses_gspo_where_the_advantage_varies_along_the_sequence_naming_both_keys():
    # the KL penalty in every token's reward (reinforce_plus_plus's default with loss.kl_coef > 0, or set true)
    for extra in (["rl.loss.kl_coef=0.05"], ["rl.loss.kl_coef=0.05", "rl.advantages.kl_in_reward=true"]):
        with pytest.raises(ConfigError, match=r"^rl\.policy_loss: 'gspo' .*advantages\.kl_in_reward") as e:
            load_config(GRPO_DEMO, GSPO + extra)
        assert "loss.kl_coef" in str(e.value)
    # a discount: the return of an earlier token is the reward discounted more
    with pytest.raises(ConfigError, match=r"^rl\.policy_loss: 'gspo' .*advantages\.gamma = 0\.9"):
        load_config(GRPO_DEMO, GSPO + ["rl.advantages.gamma=0.9"])


# ------------------------------------------------------------------ the equations, written out
def _paper_loss(rewards, lengths, logp, old, ref, *, beta, lo, hi):
    """REINFORCE++ (gamma = 1, KL in the loss) advantages and GSPO's seq-mean loss plus beta x the k1 KL term."""
    n = len(lengths)
    per_token = torch.cat([torch.full((L,), float(rewards[i]), dtype=torch.float64) for i, L in enumerate(lengths)])
    mean, std = per_token.mean(), torch.sqrt(per_token.var() + 1e-8)  # over every response token (unbiased var)
    adv = [(float(rewards[i]) - mean) / std for i in range(n)]
    terms, kls, start = [], [], 0
    for i, L in enumerate(lengths):
        lp, o, r = logp[start:start + L], old[start:start + L], ref[start:start + L]
        s = torch.exp((lp - o).mean())  # (pi_theta(y_i) / pi_old(y_i)) ** (1 / |y_i|)
        terms.append(torch.maximum(-adv[i] * s, -adv[i] * s.clamp(1 - lo, 1 + hi)))
        kls.append((lp - r).mean())  # k1, averaged over the sequence (seq-mean)
        start += L
    return torch.stack(terms).mean() + beta * torch.stack(kls).mean(), adv


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_the_gspo_loss_on_reinforce_pp_advantages_equals_the_equations(beta):
    g = torch.Generator().manual_seed(7)
    n = 6
    rewards = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5
    lengths = torch.randint(1, 8, (n,), generator=g).tolist()
    old = -torch.rand(sum(lengths), generator=g, dtype=torch.float64) * 3
    ref = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.3
    # a policy moved from the sampling one: some sequences inside the clip range, some outside
    logp = (old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.2).requires_grad_(True)
    keys = dict(advantage=RPP, policy_loss="gspo", group_size=1, loss__kl_coef=beta, loss__loss_agg="seq-mean",
                loss__clip_ratio_low=0.05, loss__clip_ratio_high=0.08)
    if beta > 0:
        keys.update(advantages__kl_in_reward=False, loss__kl_estimator="k1")
    rl = rl_config(validate=True, **keys)

    adv = compute_group_advantages(rewards.float(), 1, estimator=RPP).advantages
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    samples = [TrainSample(prompt=None, response_ids=torch.zeros(L, dtype=torch.long),  # type: ignore[arg-type]
                           behav_logp=old[a:a + L].float(), advantage=float(x), old_logp=old[a:a + L].float(),
                           ref_logp=ref[a:a + L].float(), score=float(r))
               for L, a, x, r in zip(lengths, starts, adv, rewards)]
    BatchAdvantages(rl, DataShards(rank=0, world=1, copies=1, device=torch.device("cpu"))).prepare(samples)
    token_adv = torch.cat([s.token_advantages for s in samples]).double()  # type: ignore[misc]
    seq_ids = torch.cat([torch.full((L,), i) for i, L in enumerate(lengths)])
    spec = PolicyLossSpec.from_config(rl, decoupled=False)
    out = compute_policy_loss(spec, logp, old, token_adv, torch.ones_like(old, dtype=torch.bool), seq_ids=seq_ids,
                              ref_logp=ref if beta > 0 else None)
    (grad,) = torch.autograd.grad(out.loss, logp)

    want, want_adv = _paper_loss(rewards, lengths, logp, old, ref, beta=beta, lo=0.05, hi=0.08)
    (want_grad,) = torch.autograd.grad(want, logp)
    for s, a in zip(samples, want_adv):  # one advantage per sequence, the paper's
        torch.testing.assert_close(s.token_advantages.double(), torch.full((s.response_length,), float(a),  # type: ignore[union-attr]
                                                                           dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert 0 < float(out.metrics["clip_frac"]) < 1  # both sides of the clip are exercised


def test_a_tiny_grpo_loop_trains_with_reinforce_pp_and_gspo():
    """The whole synchronous step (rollout, reference and old log-probs, REINFORCE++ advantages, packed GSPO loss):
    the loss takes the advantages (one per sequence: it raises otherwise), the KL stays a loss term, and the policy
    learns the rewarded token."""
    import math

    from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
    from tests.unit.rl.bigram_loop import NEW, BigramPolicy, FrozenReference, bigram_grpo_step, prompts, target_prob

    torch.manual_seed(0)
    rl = rl_config(validate=True, advantage=RPP, policy_loss="gspo", group_size=1, prompts_per_step=8,
                   max_new_tokens=NEW, rewards=[ExactMatchRewardConfig()], loss_agg="seq-mean", kl_coef=0.05,
                   kl_estimator="k1", recompute_logprobs=True, advantages__kl_in_reward=False)
    policy = BigramPolicy()
    grpo = bigram_grpo_step(rl, policy, reference=FrozenReference(policy))
    assert grpo.policy.loss_spec.kl_coef == 0.05 and grpo.policy.loss_spec.variant == "gspo"
    pool = prompts(8)
    before = target_prob(policy)
    rows = [grpo.run(step, pool, prompt_pool=pool) for step in range(6)]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["actor/kl"]) for r in rows)
    assert "advantage/kl_in_reward" not in rows[-1]
    assert target_prob(policy) > before + 0.2, (before, target_prob(policy))
