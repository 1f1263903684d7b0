"""`rl.batch.group_size = 1` (one completion per prompt, verl's PPO with `rollout.n = 1`): allowed exactly for the
estimators whose baseline is not the prompt's group (the registry's `needs_groups`; `gae`, PPO with a critic), refused
naming the key and the estimator for the group-relative ones (a group of one has advantage 0 always), and refused
with what needs groups of two or more (dropping equal-reward groups, dynamic sampling: every group of one has equal
rewards). A PPO step with G = 1 trains on the critic's GAE advantages (compared with a plain transcription of the
paper's equations) and learns a small bandit; `--check` plans it; the rollout's requests ask for one completion.
"""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.advantages import compute_group_advantages
from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, min_group_size
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.critic.value_model import ValueModel
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
from megatron_vlm.rl.rounds import sampling_params
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.bigram_loop import (
    NEW,
    VOCAB,
    BigramPolicy,
    SamplingEngine,
    bigram_grpo_step,
    prompts,
    spy_on_update,
    target_prob,
)
from tests.unit.rl.test_ppo_gae_value_loss import gae_reference

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


# ------------------------------------------------------------------ which estimators need groups
def test_the_registry_says_which_estimators_need_groups():
    assert {n: ADVANTAGE_ESTIMATORS.get(n).needs_groups for n in ADVANTAGE_ESTIMATORS} == {
        "grpo": True, "dr_grpo": True, "rloo": True, "reinforce_plus_plus": False, "reinforce_plus_plus_baseline": True,
        "gae": False}
    assert [min_group_size(n) for n in ("grpo", "dr_grpo", "rloo", "gae")] == [2, 2, 2, 1]


def test_gae_accepts_one_completion_per_prompt():
    rl = rl_config(validate=True, advantage="gae", group_size=1, prompts_per_step=4, mini_batches_per_step=4)
    assert rl.batch.group_size == 1
    rl_config(validate=True, advantage="gae", group_size=1, rollout_backend="vllm")


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_refuse_one_completion_naming_key_and_estimator(estimator):
    with pytest.raises(ValueError) as e:
        rl_config(validate=True, advantage=estimator, group_size=1)
    msg = str(e.value)
    assert msg.startswith("batch.group_size: 1 ") and repr(estimator) in msg and "'gae'" in msg, msg
    rl_config(validate=True, advantage=estimator, group_size=2)


@pytest.mark.parametrize("kwargs, key", [
    (dict(drop_equal_reward_groups=True), "advantages.drop_equal_reward_groups"),
    (dict(dynamic_sampling=True), "advantages.dynamic_sampling"),
])
def test_what_needs_groups_is_refused_with_one_completion(kwargs, key):
    with pytest.raises(ValueError) as e:
        rl_config(validate=True, advantage="gae", group_size=1, **kwargs)
    assert str(e.value).startswith(key + ":") and "group_size = 1" in str(e.value), str(e.value)
    rl_config(validate=True, advantage="gae", group_size=2, **kwargs)  # groups of two: as before


def test_group_size_zero_is_refused_for_every_estimator():
    for est in (*GROUP_ESTIMATORS, "gae"):
        with pytest.raises(ValueError, match=r"^batch\.group_size: must be >= 1"):
            rl_config(validate=True, advantage=est, group_size=0)


def test_the_loader_refuses_a_group_estimator_with_g_1_naming_the_dotted_key():
    from megatron_vlm.config import load_config
    from megatron_vlm.config.loader import ConfigError
    from tests.unit.rl.test_ppo_config import PPO_DEMO, REPO

    with pytest.raises(ConfigError, match=r"^rl\.batch\.group_size: 1 .*'grpo'"):
        load_config(REPO / "launch" / "configs" / "demo_grpo.toml", ["rl.batch.group_size=1"])
    assert load_config(PPO_DEMO, ["rl.batch.group_size=1"]).rl.batch.group_size == 1


# ------------------------------------------------------------------ advantages of groups of one
def test_groups_of_one_under_gae():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.std of one value warns (degrees of freedom <= 0)
        res = compute_group_advantages(rewards, 1, estimator="gae")
    assert res.keep.tolist() == [True] * 3 and res.num_dropped_groups == 0
    assert res.advantages.tolist() == [0.0] * 3  # the critic gives the advantages, in the update
    assert res.group_mean.tolist() == [1.0, 0.0, 0.5] and all(math.isnan(s) for s in res.group_std.tolist())
    for est in GROUP_ESTIMATORS:
        with pytest.raises(ValueError, match="group_size"):
            compute_group_advantages(rewards, 1, estimator=est)
    with pytest.raises(ValueError, match="drop_equal_reward_groups"):
        compute_group_advantages(rewards, 1, estimator="gae", drop_equal_reward_groups=True)


# ------------------------------------------------------------------ a PPO step with G = 1
class TinyBackbone(nn.Module):
    """A family model's critic-side contract: `lm_head` and `forward(..., return_hidden=True)` -> hidden states."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, input_ids, return_hidden=False, **kw):
        return torch.tanh(self.embed(input_ids))


def _ppo(**kw):
    torch.manual_seed(0)
    keys = dict(advantage="gae", group_size=1, prompts_per_step=8, max_new_tokens=NEW, rewards=[ExactMatchRewardConfig()],
                loss_agg="token-mean", advantages__lam=0.95)
    rl = rl_config(validate=True, **{**keys, **kw})
    policy = BigramPolicy()
    values = ValueModel(TinyBackbone())
    critic = Critic(values, torch.optim.Adam(values.parameters(), lr=0.05), rl,
                    shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=0.0, seed=3)
    engine = SamplingEngine(policy)
    grpo = bigram_grpo_step(rl, policy, engine=engine, critic=critic)
    return grpo, policy, engine, spy_on_update(grpo)


def test_a_ppo_step_with_one_completion_per_prompt_trains_on_the_critics_gae():
    """One step: 8 prompts, one completion each, every one trained on its per-token GAE advantages (whitened over the
    step's tokens) computed from the critic's values and the reward on the last token, as the paper's sum of TD
    residuals gives them; no group metric that would be constant with groups of one is logged."""
    grpo, _, engine, seen = _ppo()
    pool = prompts(8)
    m = grpo.run(0, pool, prompt_pool=pool)
    assert engine.calls == [1] and m["rollout/prompts"] == 8.0
    samples = seen["samples"]
    assert len(samples) == 8 and all(s.response_length == NEW for s in samples)
    assert not grpo.policy.share_prompts  # nothing to share: one completion per prompt ("auto")
    assert _ppo(group_size=2)[0].policy.share_prompts  # the same policy shares a group's prompt
    raw = []
    for s in samples:
        rewards = [0.0] * (NEW - 1) + [float(s.score)]
        adv, ret = gae_reference(rewards, s.old_values.double().tolist(), 1.0, 0.95)
        raw += adv
        torch.testing.assert_close(s.returns.double(), torch.tensor(ret, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    a = torch.tensor(raw, dtype=torch.float64)
    whitened = (a - a.mean()) / torch.sqrt(a.var() + 1e-8)  # unbiased variance over the step's tokens
    got = torch.cat([s.token_advantages for s in samples]).double()
    torch.testing.assert_close(got, whitened, rtol=1e-4, atol=1e-5)
    assert "reward/zero_var_group_frac" not in m  # every group of one has "equal rewards": not a measurement
    for key in ("critic/value_loss", "critic/explained_var", "advantage/std", "loss", "grad_norm"):
        assert math.isfinite(m[key]), key
    assert m["advantage/std"] == pytest.approx(1.0, rel=1e-3) and m["grad_norm"] > 0


def test_ppo_with_one_completion_per_prompt_learns_the_bandit():
    """30 steps of 8 prompts x 1 completion: the policy's probability of the rewarded token and the reward rise, and
    the critic's values follow the returns (explained variance up from ~0)."""
    grpo, policy, _, _ = _ppo()
    pool = prompts(8)
    before = target_prob(policy)
    rows = [grpo.run(step, pool, prompt_pool=pool) for step in range(30)]
    reward = [r["reward/mean"] for r in rows]
    assert target_prob(policy) > before + 0.3, (before, target_prob(policy))
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.3, reward
    assert rows[-1]["critic/values_old_mean"] > 0.3 > rows[0]["critic/values_old_mean"]


# ------------------------------------------------------------------ rollout requests and the plan
def test_the_vllm_backend_asks_one_completion_per_prompt(monkeypatch):
    """The vLLM back end's requests of a G = 1 run (a fake in-process vLLM engine: vLLM is not installed here): one
    request per prompt with n = 1, one sample per prompt back."""
    import sys
    import types

    from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer
    from tests.unit.rl.test_stop_strings import _FakeVSP, _vllm_engine

    for name, attrs in (("vllm", {"SamplingParams": _FakeVSP}),
                        ("vllm.sampling_params", {"RequestOutputKind": NS(DELTA="delta")})):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for k, v in attrs.items():
            setattr(sys.modules[name], k, v)
    tok = build_tiny_tokenizer()
    ids = tok.encode("the answer")
    out = NS(index=0, token_ids=ids, logprobs=[{t: NS(logprob=-0.5)} for t in ids], text="the answer",
             finish_reason="length", stop_reason=None)
    e = _vllm_engine(tok, [out])
    sent = []
    del e.add_request  # the engine's own request building
    e.llm._preprocess_cmpl_one = lambda request, _: request
    e.llm.llm_engine.add_request = lambda rid, request, sp: (sent.append(sp), e.llm.llm_engine.pending.append(rid))
    rl = rl_config(validate=True, advantage="gae", group_size=1, rollout_backend="vllm", max_new_tokens=len(ids))
    prompts = [RolloutPrompt(input_ids=torch.tensor(tok.encode(t))) for t in ("hi", "two plus two")]
    result = e.generate(prompts, sampling_params(rl))
    assert [sp["n"] for sp in sent] == [1, 1]
    assert [(s.prompt_index, s.sample_index) for s in result.samples] == [(0, 0), (1, 0)]


def test_check_plans_a_ppo_run_with_one_completion_per_prompt(tmp_path):
    import io

    from megatron_vlm.config import load_config
    from megatron_vlm.plan.check import run_check
    from tests.unit.rl.test_ppo_config import PPO_DEMO

    cfg = load_config(PPO_DEMO, [f'model.path="{tmp_path / "m"}"', 'model.synthesize="tiny_qwen2_5_vl"',
                                 "rl.batch.group_size=1"])
    out, err = io.StringIO(), io.StringIO()
    assert run_check(cfg, world_size=2, device_memory_gib=80.0, out=out, err=err) == 0, err.getvalue()
    assert "x group 1, 16 sequences" in out.getvalue(), out.getvalue()
