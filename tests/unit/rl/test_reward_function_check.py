"""A custom reward function that cannot be imported is a config error when the run builds its rewards.

Found by a GRPO job whose `rl.rewards` named a function missing from its module: the job ran to the
end, every reward call scored 0 with an error warning, and the policy trained on nothing (all
advantages 0). The reward workers now report, when they start, which custom functions they could not
import, and `RewardManager` raises ConfigError naming `rl.rewards[i].function` (exit 2).
"""
from __future__ import annotations

import pytest

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.rewards.config import CustomRewardConfig, MathRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.rl.rewards.pool import RewardWorkerPool

FNS = "rl_reward_fns_for_tests"


@pytest.mark.parametrize("function, expect", [
    (f"{FNS}.no_such_fn", r"'no_such_fn' is not a callable in 'rl_reward_fns_for_tests'"),
    ("no_such_module_xyz.fn", r"cannot import module 'no_such_module_xyz'"),
])
def test_unimportable_custom_reward_names_its_key(function, expect):
    rewards = [MathRewardConfig(), CustomRewardConfig(name="mine", function=function)]
    with pytest.raises(ConfigError, match=rf"^rl\.rewards\[1\]\.function: custom reward '{function}': {expect}"):
        RewardManager(rewards, timeout_s=30.0, num_workers=1)


def test_importable_custom_reward_starts_and_scores():
    with RewardWorkerPool(num_workers=1, timeout_s=30.0, preload=(f"{FNS}.boom", f"{FNS}.nope")) as pool:
        failed = pool.start()
        assert list(failed) == [f"{FNS}.nope"] and "not a callable" in failed[f"{FNS}.nope"]
    rewards = [CustomRewardConfig(name="len", function=f"{FNS}.value_of_completion")]
    with RewardManager(rewards, timeout_s=30.0, num_workers=1) as m:
        assert all(w.ready for w in m.pool._workers)  # started by the check
        assert m.score(["0.5"], [""]).total == [0.5]
