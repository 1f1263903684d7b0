"""`StepResult.info` is user data the rollout sums into the step metrics (env/<key>): a value that is not a dict of
named numbers used to raise in the trainer process (AttributeError on `None.items()`, OverflowError on a huge int,
TypeError sorting int and str keys), ending the whole rollout instead of one trajectory; a NaN counter made the
metric NaN. Such a reply is an environment error: the trajectory ends "env_error", counted, the message names it.
So is sys.exit in an environment run in the trainer process (sandbox = false)."""
import math

import pytest

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.session import EnvSession

FNS = "rl_env_fns_for_tests"


@pytest.mark.parametrize("info", [None, [1, 2], {1: 2.0}, {"calls": math.nan}, {"calls": 10**400}],
                         ids=["none", "list", "int_key", "nan", "huge_int"])
def test_bad_info_is_an_environment_error(info):
    runner = InlineEnvRunner()
    session = EnvSession(runner, encoder=None, name=f"{FNS}:InfoOf", kwargs={"info": info},
                         samples=[EnvSample(problem="q")], histories=[[]], n=2, eos_token_ids=[0])
    out = session.step([(0, 0, "a", [1]), (1, 0, "b", [1])])
    assert all(r.error and "info" in r.error for r in out), [r.error for r in out]
    assert session.errors == 2


def test_good_info_is_summed():
    runner = InlineEnvRunner()
    session = EnvSession(runner, encoder=None, name=f"{FNS}:InfoOf", kwargs={"info": {"calls": 2, "ok": True,
                                                                                       "note": "text"}},
                         samples=[EnvSample(problem="q")], histories=[[]], n=1, eos_token_ids=[0])
    (r,) = session.step([(0, 0, "a", [1])])
    assert not r.error and r.done and r.info == {"calls": 2.0, "ok": 1.0}


def test_sys_exit_in_an_inline_environment_ends_its_trajectory_not_the_job():
    """With rl.env.sandbox = false the environment runs in the trainer: SystemExit from its step escaped the runner's
    `except Exception` and ended the job, where the docs promise that only a hang stops it."""
    session = EnvSession(InlineEnvRunner(), encoder=None, name=f"{FNS}:Exits", kwargs={},
                         samples=[EnvSample(problem="q")], histories=[[]], n=1, eos_token_ids=[0])
    (r,) = session.step([(0, 0, "a", [1])])
    assert r.error and "SystemExit" in r.error and session.errors == 1


def test_a_counter_named_like_a_rollout_metric_does_not_replace_it():
    """An environment's counter is reported as env/<key>, beside the rollout's own env/* metrics: one named like them
    ("errors", "turns_mean", "finish_done", ...) used to overwrite the rollout's value (env/errors = the environment's
    own error count, the failed trajectories' count lost). Such a counter is reported as env/info/<key>."""
    import torch

    from megatron_vlm.inference.multiturn import Trajectory
    from megatron_vlm.rl.env.trajectories import trajectory_metrics

    def traj(finish, info):
        return Trajectory(prompt_index=0, sample_index=0, token_ids=torch.tensor([1, 2]),
                          model_mask=torch.tensor([True, True]), logprobs=torch.zeros(2), vision={}, text="",
                          turn_texts=["a"], turn_rewards=[], finish_reason=finish, prompt_length=3, info=info)

    m = trajectory_metrics([traj("env_error", {}), traj("done", {"errors": 5.0, "turns_mean": 9.0, "tool_calls": 2.0})])
    assert m["env/errors"] == 1.0 and m["env/turns_mean"] == 1.0 and m["env/tool_calls"] == 2.0
    assert m["env/info/errors"] == 5.0 and m["env/info/turns_mean"] == 9.0


def test_numpy_counters_are_numbers_too():
    """A counter computed with numpy (np.int64 of a sum, np.float32 of a mean) was left out of the metrics without a
    word (only Python int / float were read), and a NaN one passed the finite check."""
    import numpy as np

    session = EnvSession(InlineEnvRunner(), encoder=None, name=f"{FNS}:InfoOf",
                         kwargs={"info": {"hits": np.int64(2), "frac": np.float32(0.5)}},
                         samples=[EnvSample(problem="q")], histories=[[]], n=1, eos_token_ids=[0])
    (r,) = session.step([(0, 0, "a", [1])])
    assert not r.error and r.info == {"hits": 2.0, "frac": 0.5}, (r.error, r.info)
    session = EnvSession(InlineEnvRunner(), encoder=None, name=f"{FNS}:InfoOf",
                         kwargs={"info": {"frac": np.float32("nan")}},
                         samples=[EnvSample(problem="q")], histories=[[]], n=1, eos_token_ids=[0])
    (r,) = session.step([(0, 0, "a", [1])])
    assert r.error and "info" in r.error and session.errors == 1, r.error
