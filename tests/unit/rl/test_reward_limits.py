"""Reward worker limits: a memory cap per worker (RLIMIT_AS), workers that die with their parent (a
rank killed with SIGKILL leaves no worker busy in a hung verifier), a deadline for a whole batch of
calls (not N x the per-call limit), and non-finite / huge values clipped and counted."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_vlm.config.loader import ConfigError, from_dict
from megatron_vlm.rl.config import MOVED_KEYS, RLConfig
from megatron_vlm.rl.rewards.config import CustomRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool

FNS = "rl_reward_fns_for_tests"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_memory_cap_turns_a_runaway_verifier_into_an_error_and_clipping_is_counted():
    mgr = RewardManager([CustomRewardConfig(function=f"{FNS}.value_of_completion")], timeout_s=30.0, num_workers=1,
                        memory_limit_mb=1024, value_limit=10.0)
    with mgr:
        out = mgr.score(["0.5", "nan", "inf", "-inf", "1e30", "-3"], [""] * 6)
        assert out.total == [0.5, 0.0, 10.0, -10.0, 10.0, -3.0]
        assert (out.clipped, out.errors, out.timeouts) == (3, 1, 0)  # NaN: a failed call, not a clipped value
        assert mgr.metrics()["reward/clipped"] == 3.0
        res = mgr.pool.map([RewardCall("custom", "2048", "", function=f"{FNS}.allocate_mib"),
                            RewardCall("custom", "64", "", function=f"{FNS}.allocate_mib")])
        assert res[0].status == "error" and "MemoryError" in res[0].detail
        assert (res[1].status, res[1].value) == ("ok", 1.0)  # the same worker goes on


def test_batch_deadline_bounds_a_batch_of_hanging_calls():
    calls = [RewardCall("custom", "hang", "", function=f"{FNS}.hang") for _ in range(4)]
    with RewardWorkerPool(num_workers=1, timeout_s=2.0, batch_timeout_s=3.0) as pool:
        pool.map([RewardCall("custom", "ok", "", function=f"{FNS}.hang")])  # started and warm
        res = pool.map(calls)
        assert [r.status for r in res] == ["timeout"] * 4
        # per-call limits alone would run all four in turn (4 x 2 s); under the 3 s deadline the last is never
        # started (what bounds the batch; its wall time is left to the load of the test machine)
        assert "batch deadline" in res[-1].detail and res[-1].detail.endswith("(not started)"), res[-1].detail
        assert pool.map([RewardCall("custom", "ok", "", function=f"{FNS}.hang")])[0].status == "ok"


def test_workers_die_with_a_killed_parent(tmp_path):
    pid_file = tmp_path / "worker.pid"
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(HERE)!r}]
        from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool
        if __name__ == "__main__":
            pool = RewardWorkerPool(num_workers=1, timeout_s=600.0)
            pool.map([RewardCall("custom", "x", "", metadata={{"pid_file": {str(pid_file)!r}}},
                                 function="{FNS}.hang_and_record_pid")])
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while worker is None and time.monotonic() < deadline:
            if pid_file.is_file() and pid_file.read_text():
                worker = int(pid_file.read_text())
            time.sleep(0.1)
        assert worker is not None, "the worker never ran the call"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the reward worker outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("key, value", [("reward_memory_limit_mb", 100), ("reward_memory_limit_mb", -1),
                                        ("reward_batch_timeout_s", 0), ("reward_abs_max", 0.0),
                                        ("rollout_memory_gib", -1.0)])
def test_limit_keys_validated(key, value):
    table, name = MOVED_KEYS[key].split(".")  # the key's place in the [rl] tables
    with pytest.raises(ConfigError, match=rf"rl\.{table}\.{name}: .*(must|>= 256)"):
        from_dict(RLConfig, {table: {name: value}}, "rl")
    good = from_dict(RLConfig, {table: {name: 1024 if key == "reward_memory_limit_mb" else 1.5}}, "rl")
    assert getattr(getattr(good, table), name) in (1024, 1.5)
