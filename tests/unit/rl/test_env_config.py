"""`[rl.env]`: every key loads and validates or is refused naming the key (exit 2 through the launcher), the
combinations multi-turn rollouts do not run in are refused naming the key to change (rollout.weights); the vLLM
back end and the asynchronous loop take [rl.env], and the trajectory reward's turn rewards are summed
or discounted as documented."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.rl.env.config import RLEnvConfig

REPO = Path(__file__).resolve().parents[3]
DEMO_GRPO = REPO / "launch" / "configs" / "demo_grpo.toml"
ENV = 'rl.env={name = "calculator", max_turns = 3, max_total_tokens = 256, turn_timeout_s = 5.0}'
COPY = 'rl.rollout.weights="copy"'


def _load(*sets):
    return load_config(DEMO_GRPO, list(sets))


def test_every_key_loads():
    cfg = _load('rl.env={name = "x.y:Z", kwargs = {a = 1, b = "c"}, max_turns = 2, max_total_tokens = 300, '
                'turn_timeout_s = 2.5, turn_rewards = "discounted", discount = 0.5, sandbox = false}', COPY)
    e = cfg.rl.env
    assert (e.name, e.kwargs, e.max_turns, e.max_total_tokens, e.turn_timeout_s, e.turn_rewards, e.discount,
            e.sandbox) == ("x.y:Z", {"a": 1, "b": "c"}, 2, 300, 2.5, "discounted", 0.5, False)
    assert _load().rl.env is None  # absent: single-turn GRPO


@pytest.mark.parametrize("table, key", [
    ('{max_turns = 2}', "rl.env.name"),
    ('{name = "calculator", max_turns = 0}', "rl.env.max_turns"),
    ('{name = "calculator", max_total_tokens = -1}', "rl.env.max_total_tokens"),
    ('{name = "calculator", turn_timeout_s = 0.0}', "rl.env.turn_timeout_s"),
    ('{name = "calculator", discount = 0.9}', "rl.env.discount"),
    ('{name = "calculator", turn_rewards = "discounted", discount = 1.5}', "rl.env.discount"),
    ('{name = "calculator", turn_rewards = "mean"}', "rl.env.turn_rewards"),
    ('{name = "calculator", max_turn = 2}', "rl.env.max_turn"),
    ('{name = ""}', "rl.env.name"),
])
def test_bad_values_name_the_key(table, key):
    with pytest.raises(ConfigError) as e:
        _load(f"rl.env={table}", COPY)
    assert key in str(e.value), str(e.value)


@pytest.mark.parametrize("sets, key", [
    ([ENV], "rl.rollout.weights"),
    ([ENV, COPY, 'rl.rollout_backend="vllm"'], "rl.rollout.weights"),  # the built-in engine's key, as single-turn
    # DAPO's overlong shaping measures a response against rollout.max_new_tokens, the budget of ONE model turn: a
    # trajectory's model tokens summed over its turns were penalised as overlong when no turn came near the limit
    ([ENV, COPY, "rl.rollout.max_new_tokens=64", "rl.advantages.overlong_buffer=16",
      "rl.advantages.overlong_penalty=1.0"],
     "rl.advantages.overlong_buffer"),
    # the environment's turn rewards are the round's per-reward "env" (reward/env): a verifier of that name was
    # overwritten by them (its metric, and the accuracy when it was the accuracy reward)
    ([ENV, COPY, 'rl.rewards=[{type = "exact_match", name = "env"}]'], "rl.rewards[0].name"),
])
def test_unsupported_combinations_name_the_key(sets, key):
    with pytest.raises(ConfigError) as e:
        _load(*sets)
    assert str(e.value).startswith(key), str(e.value)


def test_vllm_backend_and_async_loop_take_env():
    cfg = _load(ENV, 'rl.rollout_backend="vllm"')
    assert cfg.rl.env is not None and cfg.rl.rollout_backend == "vllm"
    cfg = _load(ENV, COPY, 'rl.allocation="rollout:1+train:1"')
    assert cfg.rl.env is not None and cfg.rl.allocation is not None


def test_check_refuses_a_trajectory_longer_than_a_pack(tmp_path):
    """`--check` (plan/check.py) and the run share the check (rl/prompts/lengths.py)."""
    from megatron_vlm.rl.prompts.lengths import check_generation_budget

    cfg = _load('rl.env={name = "calculator", max_total_tokens = 100000}', COPY)
    with pytest.raises(ConfigError, match=r"^rl.env.max_total_tokens: 100000 exceeds data.max_tokens_per_pack"):
        check_generation_budget(cfg.data, cfg.rl)
    cfg = _load(ENV, COPY)
    check_generation_budget(cfg.data, cfg.rl)


@pytest.mark.heavy
def test_launcher_check_exits_2_naming_the_key(tmp_path):
    cmd = [sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(DEMO_GRPO), "--check",
           "--device-memory-gib", "80", "--set", f"train.output_dir=\"{tmp_path / 'out'}\"", "--set", COPY,
           "--set", f"model.path=\"{tmp_path / 'm'}\"", "--set", 'model.synthesize="tiny_qwen2_5_vl"',
           "--set", f"data.synthetic_dir=\"{tmp_path / 'd'}\""]
    r = subprocess.run([*cmd, "--set", 'rl.env={name = "calculator", max_total_tokens = 100000}'], capture_output=True,
                       text=True, timeout=180, cwd=str(REPO))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "rl.env.max_total_tokens: 100000 exceeds data.max_tokens_per_pack" in lines[-1], r.stderr
    r = subprocess.run([*cmd, "--set", ENV], capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-2000:]


def test_turn_rewards_sum_or_discounted():
    assert RLEnvConfig(name="x").trajectory_return([1.0, 0.5, 2.0]) == 3.5
    d = RLEnvConfig(name="x", turn_rewards="discounted", discount=0.5)
    assert d.trajectory_return([1.0, 0.5, 2.0]) == 1.0 + 0.25 + 0.5
