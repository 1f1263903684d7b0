"""An environment's per-turn reward enters the trajectory's reward and so its group's advantages: a NaN or infinite
reward would turn every advantage of the group into NaN (the error trajectory itself is not trained, but the
group's mean and std are). Such a reply is an environment error: the trajectory ends "env_error", counted, with a
message naming the value, and its reward is never summed."""
import math

import pytest

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.pool import EnvCall, InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession

FNS = "rl_env_fns_for_tests"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_turn_reward_is_an_environment_error(value):
    runner = InlineEnvRunner()
    state = runner.run([EnvCall("reset", name=f"{FNS}:RewardOf", kwargs={"value": value},
                                sample=EnvSample(problem="q"))])[0]
    assert not state.error
    reply = runner.run([EnvCall("step", state=state.state, action="a")])[0]
    assert reply.result is None and "reward" in reply.error and repr(value) in reply.error
    session = EnvSession(runner, encoder=None, name=f"{FNS}:RewardOf", kwargs={"value": value},
                         samples=[EnvSample(problem="q")], histories=[[]], n=2, eos_token_ids=[0])
    out = session.step([(0, 0, "a", [1])])
    assert out[0].error and out[0].reward == 0.0 and session.errors == 1


def test_a_finite_reward_passes():
    runner = InlineEnvRunner()
    state = runner.run([EnvCall("reset", name=f"{FNS}:RewardOf", kwargs={"value": 2}, sample=EnvSample(problem="q"))])[0]
    reply = runner.run([EnvCall("step", state=state.state, action="a")])[0]
    assert not reply.error and reply.result.reward == 2.0 and reply.result.done
