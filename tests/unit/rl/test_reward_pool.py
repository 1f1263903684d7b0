"""Reward worker pool and manager: weighted sums per verifier, custom functions by dotted path, and
failure handling — a hanging verifier times out (its worker is replaced and later calls still run),
a raising / exiting / crashing verifier gives 0 and is counted, never a stall or an exception."""
import logging
import time

import pytest

from megatron_vlm.rl.rewards.config import CustomRewardConfig, FormatRewardConfig, MathRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool

FNS = "rl_reward_fns_for_tests"


# Time limits: calls that must succeed get a generous limit (a loaded 2-core CI machine can take
# seconds for a first sympy parse); the hanging verifier never returns, so its timeout is certain
# whatever the limit. `pool` is warmed up (workers started, verifiers imported and run once) before
# any test relies on its timing.
HANG_POOL_TIMEOUT_S = 3.0
GENEROUS_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pool():
    with RewardWorkerPool(num_workers=2, timeout_s=GENEROUS_TIMEOUT_S) as p:
        p.map([RewardCall("math", "\\boxed{1}", "1"), RewardCall("format", "<think>a</think>b", "")] * 2)
        yield p


@pytest.fixture(scope="module")
def hang_pool():
    """A short time limit, used only with calls that finish instantly or never."""
    with RewardWorkerPool(num_workers=2, timeout_s=HANG_POOL_TIMEOUT_S) as p:
        p.map([RewardCall("custom", "ok", "", function=f"{FNS}.hang")] * 2)
        yield p


def test_builtin_and_custom_calls(pool):
    calls = [
        RewardCall("math", "so \\boxed{\\frac{6}{4}}", "1.5"),
        RewardCall("math", "so \\boxed{2}", "1.5"),
        RewardCall("custom", "abcde", "", function=f"{FNS}.length_bonus", options={"scale": 2.0}),
        RewardCall("custom", "x", "", metadata={"bonus": 0.25}, function=f"{FNS}.uses_metadata"),
        RewardCall("format", "<think>a</think>b", ""),
    ]
    res = pool.map(calls)
    assert [r.status for r in res] == ["ok"] * 5
    assert [r.value for r in res] == [1.0, 0.0, 1.0, 0.25, 1.0]


def test_errors_become_zero_with_reason(pool):
    calls = [
        RewardCall("custom", "a", "", function=f"{FNS}.boom"),
        RewardCall("custom", "a", "", function=f"{FNS}.exit_call"),
        RewardCall("custom", "a", "", function=f"{FNS}.not_a_number"),
        RewardCall("custom", "a", "", function=f"{FNS}.NOT_CALLABLE"),
        RewardCall("custom", "a", "", function="no_such_module_xyz.fn"),
        RewardCall("nope", "a", ""),
        RewardCall("math", "\\boxed{1}", "1"),
    ]
    res = pool.map(calls)
    assert [r.status for r in res] == ["error", "error", "error", "error", "error", "error", "ok"]
    assert all(r.value == 0.0 for r in res[:6])
    assert "RuntimeError: verifier bug" in res[0].detail
    assert "SystemExit" in res[1].detail
    assert "NaN" in res[2].detail  # no value at all: a failed call (scored 0), as a raising verifier's
    assert "not a callable" in res[3].detail and "cannot import" in res[4].detail
    assert "unknown reward verifier" in res[5].detail


def test_hanging_verifier_times_out_and_pool_recovers(hang_pool):
    pool = hang_pool
    restarts = pool.restarts
    calls = [RewardCall("custom", c, "", function=f"{FNS}.hang") for c in ("ok", "hang", "ok", "hang", "ok", "ok")]
    t0 = time.monotonic()
    res = pool.map(calls)
    elapsed = time.monotonic() - t0
    assert [r.status for r in res] == ["ok", "timeout", "ok", "timeout", "ok", "ok"]
    assert res[1].value == 0.0 and f"{HANG_POOL_TIMEOUT_S:g}s" in res[1].detail
    assert pool.restarts == restarts + 2
    assert elapsed < 60  # bounded: two timeouts of 3 s plus worker restarts, never a stall
    # the replaced workers serve later calls (instant ones: this pool's limit is short)
    assert [r.status for r in pool.map([RewardCall("custom", "ok", "", function=f"{FNS}.hang")] * 4)] == ["ok"] * 4


def test_crashing_worker_is_replaced(pool):
    calls = [RewardCall("custom", c, "", function=f"{FNS}.hard_crash") for c in ("a", "crash", "b")]
    res = pool.map(calls)
    assert [r.status for r in res] == ["ok", "error", "ok"]
    assert "died (exit code 7)" in res[1].detail


def test_a_stop_request_signal_is_left_to_the_rank(pool):
    """SIGUSR1 (a SLURM stop request, sent to every process of the step) asks the rank to checkpoint and stop; it
    killed the worker mid-call instead (an error result, a replaced worker): the worker ignores it as it does TERM."""
    res = pool.map([RewardCall("custom", "a", "", function=f"{FNS}.stop_request_then_score")])
    assert [(r.status, r.value) for r in res] == [("ok", 0.75)], res


def test_manager_weighted_sum_counts_and_warns(caplog):
    rewards = [
        MathRewardConfig(),
        FormatRewardConfig(weight=0.5),
        CustomRewardConfig(name="flaky", weight=2.0, function=f"{FNS}.hang"),
    ]
    completions = ["<think>r</think> \\boxed{4}", "\\boxed{5}", "hang"]
    # generous limit: 'math' and 'format' must succeed even on a loaded machine; the hang never ends
    with caplog.at_level(logging.WARNING), RewardManager(rewards, timeout_s=5.0, num_workers=2) as m:
        m.pool.map([RewardCall("math", "\\boxed{1}", "1")] * 2)  # warm-up: workers started and verifiers run once
        batch = m.score(completions, ["4", "4", "4"], prompts=["p"] * 3)
        assert batch.per_reward == {"math": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0], "flaky": [1.0, 1.0, 0.0]}
        assert batch.total == [1.0 + 0.5 + 2.0, 2.0, 0.0]
        assert batch.timeouts == 1 and batch.errors == 0
        only = m.score(completions[:2], ["4", "4"], only=["math"])
        assert only.total == [1.0, 0.0] and list(only.per_reward) == ["math"]
        assert m.metrics()["reward/timeouts"] == 1.0 and m.metrics()["reward/calls"] == 11.0
        with pytest.raises(ValueError, match="answers: 1 entries for 2"):
            m.score(["a", "b"], ["x"])
        with pytest.raises(ValueError, match="unknown reward labels"):
            m.score(["a"], ["x"], only=["nope"])
    assert any("'flaky' on completion 2: timeout" in r.getMessage() for r in caplog.records)


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        RewardWorkerPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardWorkerPool(timeout_s=0)
    assert RewardWorkerPool().map([]) == []
