"""REINFORCE++ (`[rl] advantage = "reinforce_plus_plus"` / `"reinforce_plus_plus_baseline"`, Hu et al. 2025):

- the per-token advantages equal the paper's equations transcribed here in plain torch (independent of the code under
  test): r_t = -beta KL_t + [t = last] r, G_t = sum_{s >= t} gamma^(s - t) r_s, normalised with the mean and std of
  every response token of the batch; the baseline variant subtracts the group mean of the rewards first, keeps the
  KL in the loss and does not discount; random rewards, lengths, masks and log-probs, both KL estimators;
- on two data-parallel ranks (gloo) holding different samples the normalisation is global: each rank's advantages
  equal the one-process ones over the concatenated batch (metrics included);
- one completion per prompt is accepted for reinforce_plus_plus, refused for the baseline variant naming the key
  (the loader's ConfigError, exit 2 through the entry point); advantages.gamma is read where it is used only;
- a tiny GRPO loop (in-process GRPOStep, a bigram policy and a frozen reference, kl_coef > 0) trains with each
  estimator: the KL penalty is in the returns for reinforce_plus_plus (not the loss), in the loss for the baseline
  variant, the loss stays finite and the policy learns the rewarded token.
"""
from __future__ import annotations

import math
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.rl.advantages import compute_group_advantages
from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, min_group_size, reinforce_returns
from megatron_vlm.rl.batch_advantages import BatchAdvantages
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.bigram_loop import NEW, BigramPolicy, FrozenReference, bigram_grpo_step, prompts, spy_on_update, target_prob

REPO = Path(__file__).resolve().parents[3]
GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
RPP, BASE = "reinforce_plus_plus", "reinforce_plus_plus_baseline"
WORLD = 2
ONE = DataShards(rank=0, world=1, copies=1, device=torch.device("cpu"))


# ------------------------------------------------------------------ the paper's equations, written out
def _kl(old: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return old - ref  # log(pi_old / pi_ref)
    d = ref - old
    return torch.exp(d) - d - 1  # k3 = pi_ref / pi_old - log(pi_ref / pi_old) - 1


def _paper(rewards, olds, refs, *, estimator: str, group_size: int, beta: float, gamma: float, kl_estimator: str,
           whiten: bool = True) -> list[torch.Tensor]:
    """Per-token advantages of every completion, float64: REINFORCE++ (eqs. of its sections 3-4) or with baseline."""
    n = len(rewards)
    raw = []
    for i in range(n):
        L = olds[i].numel()
        if estimator == RPP:
            r = [-beta * float(k) for k in _kl(olds[i].double(), refs[i].double(), kl_estimator)]
            r[L - 1] += float(rewards[i])
            g = [sum(gamma ** (s - t) * r[s] for s in range(t, L)) for t in range(L)]
        else:
            first = (i // group_size) * group_size
            group = [float(x) for x in rewards[first:first + group_size]]
            g = [float(rewards[i]) - sum(group) / len(group)] * L
        raw.append(torch.tensor(g, dtype=torch.float64))
    a = torch.cat(raw)
    mean, std = a.mean(), torch.sqrt(a.var() + 1e-8)  # over every response token of the batch (unbiased var)
    out, start = [], 0
    for g in raw:
        x = a[start:start + g.numel()]
        out.append((x - mean) / std if whiten else x - mean)
        start += g.numel()
    return out


def _batch(seed: int, n: int, max_len: int = 7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n, generator=g) * 2 - 0.5
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    olds = [-torch.rand(L, generator=g) * 3 for L in lengths]
    refs = [o + torch.randn(o.shape, generator=g) * 0.3 for o in olds]
    return rewards, olds, refs


def _samples(rewards, olds, refs, *, estimator: str, group_size: int) -> list[TrainSample]:
    adv = compute_group_advantages(rewards, group_size, estimator=estimator).advantages
    return [TrainSample(prompt=None, response_ids=torch.zeros(o.numel(), dtype=torch.long), behav_logp=o.clone(),  # type: ignore[arg-type]
                        advantage=float(a), old_logp=o.clone(), ref_logp=r.clone(), score=float(x))
            for a, o, r, x in zip(adv, olds, refs, rewards)]


def _rl(estimator: str, **kw):
    keys = dict(advantage=estimator, group_size=1 if estimator == RPP else 3, loss__kl_coef=0.1, loss__kl_estimator="k1")
    return rl_config(validate=True, **{**keys, **kw})


@pytest.mark.parametrize("estimator, group_size, gamma, kl_estimator, whiten", [
    (RPP, 1, None, "k1", None), (RPP, 3, 0.9, "k3", None), (RPP, 1, 0.5, "k1", False),
    (BASE, 3, None, "k1", None), (BASE, 4, None, "k3", False),
])
def test_advantages_follow_the_papers_equations(estimator, group_size, gamma, kl_estimator, whiten):
    rewards, olds, refs = _batch(1, 12)
    rl = _rl(estimator, group_size=group_size, advantages__gamma=gamma, loss__kl_estimator=kl_estimator,
             advantages__normalize_std=whiten)
    samples = _samples(rewards, olds, refs, estimator=estimator, group_size=group_size)
    metrics = BatchAdvantages(rl, ONE).prepare(samples)
    # the baseline variant's KL is a loss term: no beta in its advantages
    want = _paper(rewards, olds, refs, estimator=estimator, group_size=group_size, beta=0.1,
                  gamma=1.0 if gamma is None else gamma, kl_estimator=kl_estimator, whiten=whiten is not False)
    for s, w in zip(samples, want):
        torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-5, atol=1e-6)
    flat = torch.cat(want)
    assert metrics["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["advantage/std"] == pytest.approx(float(flat.std()), rel=1e-5)
    assert metrics["advantage/min"] == pytest.approx(float(flat.min()), rel=1e-5)
    assert ("advantage/kl_in_reward" in metrics) == (estimator == RPP)
    if estimator == RPP:
        kl = torch.cat([_kl(o.double(), r.double(), kl_estimator) for o, r in zip(olds, refs)])
        assert metrics["advantage/kl_in_reward"] == pytest.approx(float(kl.mean()), rel=1e-5)


def test_returns_skip_masked_positions_of_a_padded_or_packed_layout():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 9, generator=g) < 0.7
    gamma = 0.8
    want = torch.zeros_like(r)
    for b in range(5):
        pos = [t for t in range(9) if mask[b, t]]
        for k, t in enumerate(pos):
            want[b, t] = sum(gamma ** (j - k) * float(r[b, pos[j]]) for j in range(k, len(pos)))
    torch.testing.assert_close(reinforce_returns(r, mask, gamma=gamma), want)
    lengths = [3, 1, 5]
    flat = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    got = reinforce_returns(flat, torch.ones_like(flat, dtype=torch.bool), gamma=gamma, seq_ids=ids)
    start = 0
    for L in lengths:
        x = flat[start:start + L]
        torch.testing.assert_close(got[start:start + L], torch.tensor(
            [sum(gamma ** (s - t) * float(x[s]) for s in range(t, L)) for t in range(L)], dtype=torch.float64))
        start += L



def test_the_step_s_returns_take_one_pass_over_the_token_positions(monkeypatch):
    """The rewards-to-go of a step's samples are one padded batch: the recursion over the positions is a Python loop
    of a few tensor ops per position (~10 us), so a pass per sample cost the step samples x response length of them
    (64 samples of 8k tokens: 6 s of host time), one pass of the batch only its longest response."""
    import megatron_vlm.rl.batch_advantages as mod

    rewards, olds, refs = _batch(4, 12)
    samples = _samples(rewards, olds, refs, estimator=RPP, group_size=1)
    passes = []
    real = mod.reinforce_returns
    monkeypatch.setattr(mod, "reinforce_returns", lambda r, m, **kw: (passes.append(tuple(r.shape)), real(r, m, **kw))[1])
    BatchAdvantages(_rl(RPP, group_size=1, advantages__gamma=0.9), ONE).prepare(samples)
    assert passes == [(12, max(o.numel() for o in olds))], passes


# ------------------------------------------------------------------ the normalisation is global over the ranks
def _rank_batch():
    rewards, olds, refs = _batch(5, 9, max_len=9)
    return rewards, olds, refs


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        shards = DataShards(rank=rank, world=WORLD, copies=1, device=torch.device("cpu"))
        res = {}
        for est, G in ((RPP, 1), (BASE, 3)):
            rewards, olds, refs = _rank_batch()
            samples = _samples(rewards, olds, refs, estimator=est, group_size=G)
            # rank 0: groups 0 and 2, rank 1: group 1 (a different count of samples and tokens)
            mine = [s for i, s in enumerate(samples) if (i // 3) % WORLD == rank]
            metrics = BatchAdvantages(_rl(est, group_size=G), shards).prepare(mine)
            res[est] = ([s.token_advantages for s in mine], metrics)
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_normalise_over_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "res")), nprocs=WORLD, join=True)
    got = [torch.load(f"{tmp_path / 'res'}.{r}") for r in range(WORLD)]
    for est, G in ((RPP, 1), (BASE, 3)):
        rewards, olds, refs = _rank_batch()
        samples = _samples(rewards, olds, refs, estimator=est, group_size=G)
        metrics = BatchAdvantages(_rl(est, group_size=G), ONE).prepare(samples)
        for rank in range(WORLD):
            want = [s.token_advantages for i, s in enumerate(samples) if (i // 3) % WORLD == rank]
            assert len(got[rank][est][0]) == len(want) > 0
            for a, b in zip(got[rank][est][0], want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert got[rank][est][1].keys() == metrics.keys()
            for k, v in metrics.items():
                assert got[rank][est][1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (est, k)
        # a per-rank normalisation would differ: each rank's own tokens are not centred on the global mean
        rank0 = torch.cat(got[0][est][0])
        assert abs(float(rank0.mean())) > 1e-3


# ------------------------------------------------------------------ groups and keys
def test_the_registry_and_group_sizes():
    assert ADVANTAGE_ESTIMATORS.get(RPP).needs_groups is False and ADVANTAGE_ESTIMATORS.get(BASE).needs_groups is True
    assert min_group_size(RPP) == 1 and min_group_size(BASE) == 2
    rl_config(validate=True, advantage=RPP, group_size=1, prompts_per_step=4, mini_batches_per_step=4)
    with pytest.raises(ValueError) as e:
        rl_config(validate=True, advantage=BASE, group_size=1)
    assert str(e.value).startswith("batch.group_size: 1 ") and repr(BASE) in str(e.value) and repr(RPP) in str(e.value)
    rewards = torch.tensor([1.0, 0.0, 0.5])
    torch.testing.assert_close(compute_group_advantages(rewards, 1, estimator=RPP).advantages, rewards)
    with pytest.raises(ValueError, match="group_size"):
        compute_group_advantages(rewards, 1, estimator=BASE)


def test_an_env_error_leaves_its_group_mate_its_own_reward():
    """A sample whose environment failed is out of its group; under reinforce_plus_plus (no group baseline) the
    other sample keeps its reward as its score (a group-relative estimator gives a lone sample 0)."""
    rewards = torch.tensor([0.7, 0.2, 1.0, 0.4])
    valid = torch.tensor([True, False, True, True])
    out = compute_group_advantages(rewards, 2, estimator=RPP, valid=valid)
    torch.testing.assert_close(out.advantages, torch.tensor([0.7, 0.0, 1.0, 0.4]))
    out = compute_group_advantages(rewards, 2, estimator=BASE, valid=valid)
    torch.testing.assert_close(out.advantages, torch.tensor([0.0, 0.0, 0.3, -0.3]))


def test_the_loader_accepts_g1_for_reinforce_pp_and_refuses_it_for_the_baseline():
    from megatron_vlm.config import load_config
    from megatron_vlm.config.loader import ConfigError

    cfg = load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', "rl.batch.group_size=1"])
    assert cfg.rl.advantage == RPP and cfg.rl.batch.group_size == 1
    with pytest.raises(ConfigError, match=rf"^rl\.batch\.group_size: 1 .*'{BASE}'"):
        load_config(GRPO_DEMO, [f'rl.advantage="{BASE}"', "rl.batch.group_size=1"])
    with pytest.raises(ConfigError, match=r"^rl\.advantages\.gamma: .*'reinforce_plus_plus_baseline'"):
        load_config(GRPO_DEMO, [f'rl.advantage="{BASE}"', "rl.advantages.gamma=0.9"])
    with pytest.raises(ConfigError, match=r"^rl\.advantages\.lam: "):
        load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', "rl.advantages.lam=0.9"])
    with pytest.raises(ConfigError, match=r"^rl\.policy_loss: 'gspo' .*reinforce_plus_plus"):  # KL in every token's reward
        load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', 'rl.policy_loss="gspo"', "rl.loss.kl_coef=0.05"])
    assert load_config(GRPO_DEMO, [f'rl.advantage="{RPP}"', "rl.advantages.gamma=0.9"]).rl.advantages.gamma == 0.9


@pytest.mark.heavy  # a subprocess (~10 s); the loader test above covers the ConfigError it exits 2 with
def test_the_entry_point_exits_2_naming_the_key():
    r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(GRPO_DEMO), "--check",
                        "--set", f'rl.advantage="{BASE}"', "--set", "rl.batch.group_size=1"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rl.batch.group_size: 1 " in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ a tiny GRPO loop
def _loop(estimator: str, group_size: int, kl_coef: float = 0.05):
    torch.manual_seed(0)
    rl = rl_config(validate=True, advantage=estimator, group_size=group_size, prompts_per_step=8 // group_size,
                   max_new_tokens=NEW, rewards=[ExactMatchRewardConfig()], loss_agg="token-mean", kl_coef=kl_coef,
                   kl_estimator="k1", recompute_logprobs=True)
    policy = BigramPolicy()
    grpo = bigram_grpo_step(rl, policy, reference=FrozenReference(policy))
    return grpo, policy, spy_on_update(grpo)


@pytest.mark.parametrize("estimator, group_size", [(RPP, 1), (BASE, 2)])
def test_a_tiny_grpo_loop_trains_with_the_estimator(estimator, group_size):
    grpo, policy, seen = _loop(estimator, group_size)
    # reinforce_plus_plus: the penalty is in the returns; the baseline variant: in the loss, as the paper
    assert grpo.policy.loss_spec.kl_coef == (0.0 if estimator == RPP else 0.05)
    assert not grpo.policy.skip_zero_adv
    pool = prompts(8 // group_size)
    before = target_prob(policy)
    rows = []
    for step in range(25):
        rows.append(grpo.run(step, pool, prompt_pool=pool))
        if step == 2:  # the advantages of a step where the policy has moved from the reference
            samples = seen["samples"]
            assert len(samples) == 8
            rewards = torch.tensor([s.score for s in samples])
            want = _paper(rewards, [s.old_logp for s in samples], [s.ref_logp for s in samples], estimator=estimator,
                          group_size=group_size, beta=0.05, gamma=1.0, kl_estimator="k1")
            for s, w in zip(samples, want):
                torch.testing.assert_close(s.token_advantages.double(), w, rtol=1e-4, atol=1e-5)
            assert any(float((s.old_logp - s.ref_logp).abs().max()) > 1e-3 for s in samples)
    for r in rows:
        for key in ("loss", "grad_norm", "advantage/std", "actor/kl"):
            assert math.isfinite(r[key]), key
    # whitened: std 1 over the step's tokens (0 once every group of the baseline variant is solved: all advantages 0)
    assert all(r["advantage/std"] == pytest.approx(1.0, rel=1e-3) or r["advantage/std"] == 0.0 for r in rows)
    assert rows[0]["advantage/std"] == pytest.approx(1.0, rel=1e-3)
    assert ("advantage/kl_in_reward" in rows[-1]) == (estimator == RPP)
    assert target_prob(policy) > before + 0.2, (before, target_prob(policy))


@pytest.mark.parametrize("estimator", [RPP, BASE])
def test_multi_turn_trajectories_get_returns_over_the_models_tokens(estimator):
    """[rl.env]: a trajectory's advantages cover its model tokens only (the environment's turns are context), the
    failed trajectory is neither trained nor normalised over, and the environment-only token gets no gradient."""
    from tests.unit.rl.test_grpo_step_algorithms import _grpo
    from tests.unit.rl.test_grpo_step_algorithms import _pool as _pool_graded
    from tests.unit.rl.test_multiturn_grpo_step import ENV_LAST, ENV_ONLY, ScriptedMultiTurn

    pool = [p for p in _pool_graded(40) if int(p.prompt_id[1:]) % 2][:2]
    rl = rl_config(validate=True, advantage=estimator, group_size=3, max_new_tokens=4, prompts_per_step=2,
                   rewards=[ExactMatchRewardConfig()])
    engine = NS(load_weights=lambda *a, **k: None, release_memory=lambda: None)
    grpo, _, seen = _grpo(rl, pool, engine=engine, multiturn=ScriptedMultiTurn())
    policy = grpo.policy.bundle.wrapper
    before = policy.embed.weight.detach().clone()
    m = grpo.run(0, pool, prompt_pool=pool)
    samples = seen["samples"]
    assert len(samples) == 5 and math.isfinite(m["loss"])
    rewards = [0.1 * (j + 1) + 0.2 for j in range(3)]  # the verifiers' + the turn rewards, per trajectory of a prompt
    if estimator == RPP:
        scores = rewards[:2] + rewards
    else:  # prompt 0's group without its failed third trajectory
        scores = [r - sum(g) / len(g) for g in (rewards[:2], rewards) for r in g]
    assert [s.advantage for s in samples] == pytest.approx(scores, abs=1e-6)
    lengths = [s.response_length for s in samples]
    assert lengths == [j + 3 for j in (0, 1)] + [j + 3 for j in (0, 1, 2)]  # model tokens: j + 1 before, 2 after
    raw = torch.cat([torch.full((n,), float(a), dtype=torch.float64) for n, a in zip(lengths, scores)])
    want = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)  # no KL, gamma 1: every token's return is the score
    torch.testing.assert_close(torch.cat([s.token_advantages for s in samples]).double(), want, rtol=1e-5, atol=1e-6)
    after = policy.embed.weight.detach()
    assert torch.equal(after[ENV_ONLY], before[ENV_ONLY]) and not torch.equal(after[ENV_LAST], before[ENV_LAST])


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_returns_and_gae_of_no_token_are_empty(layout):
    """A call with no response token (a packed [0], or padded rows of no position) gives empty results of that shape,
    not an IndexError from the recursion's start."""
    from megatron_vlm.rl.algorithms.advantage_estimators import gae_advantages

    shape = (0,) if layout == "packed" else (2, 0)
    seq_ids = torch.zeros(0, dtype=torch.long) if layout == "packed" else None
    r, mask = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    ret = reinforce_returns(r, mask, gamma=0.9, seq_ids=seq_ids)
    adv, gae_ret = gae_advantages(r, torch.zeros(shape), mask, gamma=0.9, lam=0.95, seq_ids=seq_ids)
    assert ret.shape == adv.shape == gae_ret.shape == shape
