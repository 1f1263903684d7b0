"""Hostile custom reward functions, and the run-level guard against rewards that all fail:

- a function that cannot be called as `fn(completion, answer, prompt=..., metadata=..., **kwargs)` (no **kwargs,
  a required kwarg not configured) is refused when the rewards are built: ConfigError naming
  `rl.rewards[i].function` (exit 2), not 0 on every call;
- a module that calls `os._exit` at import: ConfigError naming the key, not a RuntimeError traceback;
- 10**400 is clipped to +-value_limit (`rl.reward_abs_max`), not an OverflowError scored 0;
- a string ("0.75") or None is an error result (never parsed as a number);
- an exception whose `__str__` raises is an error result and the worker survives (no restart per call);
- a verifier that starts subprocesses and hangs: at the deadline its whole process group dies;
- `RewardFailureWatch`: N steps in a row in which every call failed stop the run (exit 1 via the runner).
"""
from __future__ import annotations

import os
import time

import pytest

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.rewards.config import CustomRewardConfig
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch, RewardsAllFailedError
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool

FNS = "rl_reward_fns_hostile"


@pytest.mark.parametrize("function, kwargs, expect", [
    ("no_kwargs", {}, "got an unexpected keyword argument 'prompt'"),
    ("with_scale", {}, "missing a required argument: 'scale'"),
])
def test_a_function_that_cannot_be_called_so_is_refused_naming_its_key(function, kwargs, expect):
    rewards = [CustomRewardConfig(name="ok", function=f"{FNS}.with_scale", kwargs={"scale": 1.0}),
               CustomRewardConfig(name="bad", function=f"{FNS}.{function}", kwargs=kwargs)]
    with pytest.raises(ConfigError, match=rf"^rl\.rewards\[1\]\.function: {FNS}\.{function} cannot be called as "
                                          rf"fn\(completion, answer, prompt=\.\.\., metadata=\.\.\..*{expect}"):
        RewardManager(rewards, timeout_s=30.0, num_workers=1)


def test_a_module_that_exits_at_import_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^rl\.rewards\[0\]\.function: importing rl_reward_exit_at_import\.fn "
                                          r"ended the reward worker \(reward worker exited during start-up \(exit code 3\)"):
        RewardManager([CustomRewardConfig(function="rl_reward_exit_at_import.fn")], timeout_s=30.0, num_workers=1)


def test_values_overflow_strings_and_unprintable_exceptions():
    rewards = [CustomRewardConfig(name="huge", function=f"{FNS}.huge_int"),
               CustomRewardConfig(name="str", function=f"{FNS}.a_string"),
               CustomRewardConfig(name="none", function=f"{FNS}.none"),
               CustomRewardConfig(name="unprintable", function=f"{FNS}.raise_unprintable")]
    with RewardManager(rewards, timeout_s=30.0, num_workers=1, value_limit=10.0) as m:
        pid = m.pool._workers[0].proc.pid
        out = m.score(["pos", "neg"], ["", ""])
        assert out.per_reward["huge"] == [10.0, -10.0]
        assert out.per_reward["str"] == [0.0, 0.0] and out.per_reward["none"] == [0.0, 0.0]
        assert out.per_reward["unprintable"] == [0.0, 0.0]
        assert (out.clipped, out.errors, out.timeouts) == (2, 6, 0)
        assert m.pool.restarts == 0 and m.pool._workers[0].proc.pid == pid  # the worker survived every call
        assert "Unprintable: <the exception's message could not be printed>" in m.last_error
    pool = RewardWorkerPool(num_workers=1, timeout_s=30.0)
    with pool:
        r = pool.map([RewardCall("custom", "x", "", function=f"{FNS}.a_string")])[0]
    assert r.status == "error" and "not a number" in r.detail and "'0.75'" in r.detail


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_deadline_kills_the_verifiers_children_too(tmp_path):
    pid_file = tmp_path / "pids"
    with RewardWorkerPool(num_workers=1, timeout_s=3.0) as pool:
        r = pool.map([RewardCall("custom", "x", "", function=f"{FNS}.spawn_children_and_hang",
                                 metadata={"pid_file": str(pid_file)})])[0]
        assert r.status == "timeout"
        kids = [int(p) for p in pid_file.read_text().split()]
        assert len(kids) == 3
        t0 = time.monotonic()
        while any(_alive(k) for k in kids) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not any(_alive(k) for k in kids), "the verifier's subprocesses outlived its worker"


def test_rewards_that_all_fail_for_n_steps_stop_the_run():
    watch = RewardFailureWatch(3)
    totals = {"reward/calls": 0.0, "reward/errors": 0.0, "reward/timeouts": 0.0}

    def step(calls, errors, timeouts=0):
        totals["reward/calls"] += calls
        totals["reward/errors"] += errors
        totals["reward/timeouts"] += timeouts

    for s, (c, e, t) in enumerate([(8, 8, 0), (8, 4, 4), (8, 7, 0), (8, 8, 0), (0, 0, 0), (8, 6, 2)], start=1):
        step(c, e, t)
        watch.update(totals, s)  # a step with one good call resets; a step without calls neither counts nor resets
    assert watch.streak == 2
    step(8, 8)
    with pytest.raises(RewardsAllFailedError, match=r"^rl\.reward_pool\.max_failed_steps: every reward call failed .* 3 steps "
                                                    r"in a row, up to step 7.*last error: boom"):
        watch.update(totals, 7, "boom")
    never = RewardFailureWatch(0)
    for s in range(1, 20):
        step(4, 4)
        never.update(totals, s)


def test_the_manager_reports_the_last_error_for_the_stop_message():
    with RewardManager([CustomRewardConfig(name="b", function=f"{FNS}.always_raises")], timeout_s=30.0, num_workers=1) as m:
        m.score(["a"], [""])
        watch = RewardFailureWatch(1)
        with pytest.raises(RewardsAllFailedError, match="reward 'b': error: ValueError: broken verifier"):
            watch.update(m.metrics(), 1, m.last_error)
