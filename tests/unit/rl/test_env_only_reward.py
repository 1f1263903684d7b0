"""An `[rl.env]` run whose environment gives the reward needs no `[[rl.rewards]]` table (it needed a weight-0 one):
the trajectory's reward is the environment's turn rewards, the accuracy (training and held-out) is read from them
(label "env"). A run with neither a table nor an environment, or whose environment gives no reward of its own (the
built-in tool environments), is refused naming rl.rewards, by `--check` as by the job."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.eval.grpo_accuracy import GRPOEvaluator
from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.rl.prompts.dataset import PromptDataset, PromptSample

REPO = Path(__file__).resolve().parents[3]
COPY = 'rl.rollout.weights="copy"'


def _config_without_rewards(tmp_path) -> Path:
    text = (REPO / "launch" / "configs" / "demo_grpo.toml").read_text()
    head, _, tail = text.partition("[[rl.rewards]]")
    tail = tail[tail.index("\n["):]  # the tables after it
    path = tmp_path / "no_rewards.toml"
    path.write_text(head + tail)
    return path


def test_an_environment_reward_needs_no_reward_table(tmp_path):
    cfg = load_config(_config_without_rewards(tmp_path), ['rl.env={name = "rl_env_fns_for_tests:RewardOf", '
                                                          'kwargs = {value = 1.0}}', COPY])
    assert cfg.rl.rewards == [] and cfg.rl.accuracy_label() == "env"
    from megatron_vlm.rl.rewards.manager import RewardManager

    with RewardManager(cfg.rl.rewards, num_workers=1) as manager:  # no verifier: nothing to score, no worker
        batch = manager.score(["a", "b"], ["1", "2"])
    assert batch.total == [0.0, 0.0] and batch.per_reward == {}
    with pytest.raises(ConfigError, match=r"^rl.accuracy_reward"):
        load_config(_config_without_rewards(tmp_path), ["rl.accuracy_reward=\"env\""])


@pytest.mark.parametrize("key, value", [("abs_max", "1.0"), ("timeout_s", "2.0"), ("batch_timeout_s", "60.0")])
def test_verifier_limits_without_a_verifier_are_refused(tmp_path, key, value):
    """With the environment's rewards alone there is no verifier call: the verifier pool's limits (its value clip,
    deadlines) would be accepted and do nothing, and the environment's rewards are not clipped. max_failed_steps
    counts the environment's failed episodes too: accepted."""
    env = 'rl.env={name = "rl_env_fns_for_tests:RewardOf", kwargs = {value = 1.0}}'
    with pytest.raises(ConfigError, match=rf"^rl.reward_pool.{key}: .*no \[\[rl.rewards\]\] verifier"):
        load_config(_config_without_rewards(tmp_path), [env, COPY, f"rl.reward_pool.{key}={value}"])
    load_config(_config_without_rewards(tmp_path), [env, COPY, "rl.reward_pool.workers=1",  # the env workers' pool
                                                    "rl.reward_pool.memory_limit_mb=1024",
                                                    "rl.reward_pool.max_failed_steps=2"])


def test_neither_a_table_nor_an_environment_is_refused(tmp_path):
    assert [r.type for r in load_config(_config_without_rewards(tmp_path)).rl.rewards] == ["math"]  # as before
    with pytest.raises(ConfigError, match=r"^rl.rewards: at least one"):
        load_config(_config_without_rewards(tmp_path), ["rl.rewards=[]"])


def test_an_environment_without_rewards_still_needs_a_table(tmp_path, monkeypatch, capsys):
    from megatron_vlm.plan import check
    from megatron_vlm.rl.env.rollout import MultiTurnRounds

    monkeypatch.setattr(check, "plan_run", lambda cfg, **kw: [])
    bare = load_config(_config_without_rewards(tmp_path), ['rl.env={name = "calculator"}', COPY])
    assert check.run_check(bare, world_size=1, device_memory_gib=80.0) == 2
    out = capsys.readouterr()
    assert "check failed: rl.rewards: " in out.out + out.err
    with pytest.raises(ConfigError, match=r"^rl.rewards: .*calculator.* gives no reward"):
        MultiTurnRounds.from_config(bare.rl, 4096, engine=None, processor=None)
    own = load_config(_config_without_rewards(tmp_path), ['rl.env={name = "rl_env_fns_for_tests:RewardOf"}', COPY])
    assert check.run_check(own, world_size=1, device_memory_gib=80.0) == 0


@pytest.mark.parametrize("sets", [['rl.env={name = "calculator", turn_rewards = "discounted", discount = 0.9}'],
                                  ['rl.env={name = "calculator", turn_rewards = "discounted"}']])
def test_turn_reward_settings_of_an_environment_without_rewards_are_refused(sets):
    """`rl.env.turn_rewards` / `discount` shape the environment's per-turn rewards: with an environment that gives
    none (the built-in calculator, verifiers scoring the final answer) they would be accepted and do nothing."""
    from megatron_vlm.rl.env.rollout import environment_tools

    cfg = load_config(REPO / "launch" / "configs" / "demo_calculator_grpo.toml", sets)
    with pytest.raises(ConfigError, match=r"^rl.env.turn_rewards: .*calculator.* gives no reward"):
        environment_tools(cfg.rl.env, verifiers=True)
    environment_tools(load_config(REPO / "launch" / "configs" / "demo_calculator_grpo.toml").rl.env)  # "sum": kept


def test_a_tool_environment_subclass_with_its_own_step_may_give_rewards():
    """A ToolEnvironment without reward_fn gives no reward, but a subclass that writes its own `step` may return
    rewards there: it is not refused for the missing [[rl.rewards]] table."""
    from megatron_vlm.rl.env.base import Observation, StepResult
    from megatron_vlm.rl.env.tools import ToolEnvironment

    class Scored(ToolEnvironment):
        def step(self, action: str) -> StepResult:
            return StepResult(observation=Observation(), done=True, reward=1.0)

    assert ToolEnvironment().gives_rewards is False
    assert ToolEnvironment(reward_fn=lambda text, sample: 1.0).gives_rewards is True
    assert Scored().gives_rewards is True


def _sample(p: int, j: int) -> RolloutSample:
    return RolloutSample(prompt_index=p, sample_index=j, token_ids=torch.tensor([1, 2]), logprobs=torch.zeros(2),
                         text="42", finish_reason="eos", prompt_length=3)


class _MultiTurn:
    """Conversations whose environment pays 1.0 to the first sample of each prompt, 0.25 to the others."""

    def generate(self, shard, params, seed):  # noqa: ARG002
        n = shard.num_real
        trajs = [NS(turn_rewards=[1.0 if j == 0 else 0.25], finish_reason="done") for p in range(n)
                 for j in range(params.n)]
        return RolloutResult(samples=[_sample(p, j) for p in range(n) for j in range(params.n)]), trajs

    def rewards(self, trajs):
        return [sum(t.turn_rewards) for t in trajs]


class _Encoder:
    skipped = 0

    def encode(self, s: PromptSample):
        return RolloutPrompt(input_ids=torch.tensor([5, 6, 7]))


class _NoVerifiers:
    def score(self, *a, only=None, **kw):
        raise AssertionError(f"scored with verifiers {only}: the accuracy is the environment's")


def test_held_out_accuracy_of_an_environment_reward():
    ctx = NS(env=NS(rank=0, world_size=1, device=torch.device("cpu")), cfg=NS(train=NS(seed=0)))
    rl = NS(eval=NS(max_prompts=0, max_new_tokens=8, k=2, temperature=1.0, top_p=1.0, correct_threshold=1.0),
            rollout=NS(max_new_tokens=8, stop=[]), accuracy_label=lambda: "env")
    samples = [PromptSample(f"p{i}", [], "42", "?", source="held.jsonl", index=i) for i in range(3)]
    wrapper = NS(eval=lambda: None, train=lambda: None)
    metrics = GRPOEvaluator(ctx, wrapper, rl, NS(release_memory=lambda: None), _Encoder(), _NoVerifiers(), PromptDataset(samples, "messages"),
                            multiturn=_MultiTurn())(1)
    assert metrics is not None and metrics["accuracy"] == 0.5 and metrics["pass@2"] == 1.0


def test_a_grpo_step_on_the_environment_reward_only():
    """The step's reward is the turn rewards, its accuracy theirs ("env"), with no verifier to score anything."""
    from megatron_vlm.rl.env.config import RLEnvConfig
    from megatron_vlm.rl.rewards.manager import RewardManager
    from tests.fixtures.rl_config import rl_config
    from tests.unit.rl.test_grpo_step_algorithms import _grpo, _pool
    from tests.unit.rl.test_multiturn_grpo_step import ScriptedMultiTurn

    pool = _pool(4)[:2]
    rl = rl_config(group_size=3, max_new_tokens=4, prompts_per_step=2, rewards=[], accuracy_reward=None)
    rl.env = RLEnvConfig(name="rl_env_fns_for_tests:RewardOf")
    rl.rollout.weights = "copy"
    rl.validate()
    engine = NS(load_weights=lambda *a, **k: None, release_memory=lambda: None)
    with RewardManager(rl.rewards, num_workers=1) as manager:
        grpo, _, _ = _grpo(rl, pool, engine=engine, multiturn=ScriptedMultiTurn(), manager=manager)
        m = grpo.run(0, pool, prompt_pool=pool)
    assert m["reward/mean"] == pytest.approx(0.2) and m["reward/env"] == pytest.approx(0.2)  # two turns of 0.1
    assert m["accuracy"] == 0.0  # 0.2 < the correct threshold 1.0
