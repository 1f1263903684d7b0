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
