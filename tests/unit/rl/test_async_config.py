"""`[rl] allocation` and the asynchronous keys: the grammar (both spellings), the refusals that name
the key, and the launcher's check that the sizes add up to the number of processes (exit 2)."""
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.rl.asynchronous.allocation import Allocation, parse_allocation
from megatron_vlm.rl.asynchronous.bridge import setup_roles
from tests.fixtures.rl_config import rl_config

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text,want", [
    ("rollout:1+train:1", (1, 1)), ("train:16 + rollout:32", (32, 16)), ("vllm:d32+d16", (32, 16)),
    ("sglang:d4+d2", (4, 2)),
])
def test_allocation_grammar(text, want):
    a = parse_allocation(text)
    assert (a.rollout, a.train) == want and a.world_size == sum(want)


@pytest.mark.parametrize("text", ["rollout:2", "rollout:0+train:1", "rollout:1+rollout:1", "gen:2+train:1", "vllm:d0+d2",
                                  "rollout:1+train:1+train:1", "d32+d16", ""])
def test_allocation_refused_with_the_grammar(text):
    with pytest.raises(ValueError, match="allocation"):
        parse_allocation(text)


def test_roles_training_ranks_first():
    a = Allocation(rollout=2, train=3)
    assert [a.role_of(r) for r in range(5)] == [("train", 0), ("train", 1), ("train", 2), ("rollout", 0), ("rollout", 1)]


@pytest.mark.parametrize("kw,key", [
    (dict(max_head_offpolicyness=2), "max_head_offpolicyness"),  # needs the asynchronous loop
    (dict(allocation="rollout:1+train:1", behav_imp_weight_cap=5.0), "behav_imp_weight_cap"),  # k = 0: not read
    (dict(allocation="rollout:1+train:1", dynamic_sampling=True), "dynamic_sampling"),
    (dict(allocation="rollout:1+train:1", max_head_offpolicyness=1, recompute_logprobs=True, rollout_correction="tis"),
     "rollout_correction"),
    (dict(allocation="vllm:32+16"), "allocation"),
])
def test_async_keys_refused(kw, key):
    with pytest.raises(ValueError, match=key):
        rl_config(**kw).validate()


def test_async_keys_accepted():
    rl_config(allocation="rollout:1+train:1", max_head_offpolicyness=2, behav_imp_weight_cap=5.0).validate()


def test_sizes_must_add_up_to_the_processes(monkeypatch):
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo_async.toml", [])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"rl.allocation: 'rollout:1\+train:1' asks for 1 rollout \+ 1 training = 2"):
        setup_roles(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="rl.allocation"):
        setup_roles(cfg)


def test_more_rollout_ranks_than_prompts_per_step_refused():
    """Rollout rank r generates prompts r, r + N, ... of a step: with fewer prompts per step than rollout ranks, the
    last ones would never get a prompt and idle the whole run."""
    with pytest.raises(ValueError, match=r"batch.prompts_per_step: 2 prompts per step for 3 rollout ranks"):
        rl_config(allocation="rollout:3+train:1", prompts_per_step=2).validate()
    rl_config(allocation="rollout:2+train:1", prompts_per_step=2).validate()
