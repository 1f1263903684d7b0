"""Runs that train on nothing stop: `rl.reward_pool.max_failed_steps` steps in a row without a usable reward.

Found: a verifier returning NaN on every call was counted as "clipped" (NaN -> 0), not failed, so the failure watch
never fired and the job trained on zero rewards to its end with exit 0; an environment that errored on every call
(every trajectory "env_error", none trained) only logged warnings. Now a NaN value is a failed call
(`reward/errors`; inf / huge values are still clipped and used), a step whose every environment episode failed counts
as a step without reward like one whose every verifier call failed, and one such step alone never stops a run. The
run stops with exit 1 and a line naming the cause and the count, after saving a checkpoint when steps that had a
reward since the newest checkpoint would otherwise be lost (training/loop.py `StopAfterStep`)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.inference.engine import RolloutResult
from megatron_vlm.inference.multiturn import Trajectory
from megatron_vlm.rl.env.rollout import rollout_view
from megatron_vlm.rl.rewards.config import CustomRewardConfig, ExactMatchRewardConfig
from megatron_vlm.rl.rewards.failure_watch import RewardFailureWatch, RewardsAllFailedError
from megatron_vlm.rl.rewards.manager import RewardManager
from megatron_vlm.training.loop import StopAfterStep, run_loop
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.test_grpo_step_algorithms import _grpo, _pool

FNS = "rl_reward_fns_for_tests"


def test_a_nan_reward_is_a_failed_call_and_inf_is_still_clipped():
    with RewardManager([CustomRewardConfig(function=f"{FNS}.value_of_completion")], timeout_s=30.0, num_workers=1,
                       value_limit=10.0) as manager:
        out = manager.score(["nan", "inf", "0.5"], [""] * 3)
        assert out.total == [0.0, 10.0, 0.5]
        assert (out.errors, out.clipped) == (1, 1)
        assert "nan" in manager.last_error.lower()
        m = manager.metrics()
        assert (m["reward/errors"], m["reward/clipped"]) == (1.0, 1.0)


def test_nan_on_every_call_stops_the_run_after_max_failed_steps():
    with RewardManager([CustomRewardConfig(name="nan", function=f"{FNS}.not_a_number")], timeout_s=30.0,
                       num_workers=1) as manager:
        watch = RewardFailureWatch(2)
        manager.score(["a", "b"], ["", ""])
        watch.update(manager.metrics(), 1, manager.last_error)  # one bad step never stops a run
        manager.score(["a", "b"], ["", ""])
        with pytest.raises(RewardsAllFailedError, match=r"^rl\.reward_pool\.max_failed_steps: every reward call failed "
                                                        r"\(raised, timed out or returned NaN\) in 2 steps in a row, up "
                                                        r"to step 2.*last error: reward 'nan': error: .*NaN"):
            watch.update(manager.metrics(), 2, manager.last_error)


def test_the_watch_counts_environment_episodes_and_one_bad_step_never_stops():
    watch = RewardFailureWatch(2)
    watch.update({}, 1, episodes=8, episode_errors=8, env_error="step: error: boom")
    watch.update({}, 2, episodes=8, episode_errors=7)  # one trajectory trained: the streak ends
    watch.update({}, 3, episodes=8, episode_errors=8)
    watch.update({}, 4, episodes=0, episode_errors=0)  # nothing rolled out: neither counts nor resets
    with pytest.raises(RewardsAllFailedError, match=r"^rl\.reward_pool\.max_failed_steps: every environment episode "
                                                    r"failed \(env_error\) in 2 steps in a row, up to step 5: .*last "
                                                    r"error: step: error: boom") as e:
        watch.update({}, 5, episodes=8, episode_errors=8, env_error="step: error: boom")
    assert e.value.streak == 2


class FailingEnvironment:
    """The multi-turn rollout of an environment that errors on every call: every trajectory ends "env_error"."""

    def generate(self, shard, params, seed):
        trajs = [Trajectory(prompt_index=p, sample_index=j, token_ids=torch.tensor([1, 2]),
                            model_mask=torch.tensor([True, True]), logprobs=torch.full((2,), -1.0), vision={},
                            text="ab", turn_texts=["ab"], turn_rewards=[], finish_reason="env_error",
                            prompt_length=len(shard.prompts[p]), error="step: error: RuntimeError: environment bug")
                 for p in range(shard.num_real) for j in range(params.n)]
        return RolloutResult(samples=[rollout_view(t) for t in trajs]), trajs

    def rewards(self, trajs):
        return [0.0 for _ in trajs]


def test_an_environment_that_errors_on_every_call_stops_the_grpo_run():
    pool = _pool(8)
    rl = rl_config(validate=True, group_size=2, max_new_tokens=4, prompts_per_step=2, rewards=[ExactMatchRewardConfig()])
    rl.reward_pool.max_failed_steps = 3
    engine = NS(load_weights=lambda *a, **k: None, release_memory=lambda: None)
    grpo, _, _ = _grpo(rl, pool, engine=engine, multiturn=FailingEnvironment())
    for step in range(2):
        assert grpo.run(step, pool[:2], prompt_pool=pool)["env/errors"] == 4
    with pytest.raises(RewardsAllFailedError, match=r"every environment episode failed \(env_error\) in 3 steps in a "
                                                    r"row, up to step 3.*environment bug") as e:
        grpo.run(2, pool[:2], prompt_pool=pool)
    assert e.value.metrics["env/errors"] == 4  # the step's metrics go with the error (the loop logs them)


# ---------------------------------------------------------------------------------------- the loop's end

class Steps:
    """Good steps until `bad_from` (0-based), then steps without reward; the `wasted`-th of them stops the run."""

    def __init__(self, bad_from: int, wasted: int, finish_fails: bool = False):
        self.bad_from, self.wasted, self.finish_fails = bad_from, wasted, finish_fails
        self.finished = 0

    def load_data_state(self, state, step):
        pass

    def train_step(self, step, *, log):
        if step == self.bad_from + self.wasted - 1:
            raise StopAfterStep(RewardsAllFailedError("no reward"), {"loss": 0.0}, wasted=self.wasted)
        return {"loss": 1.0}

    def evaluate(self, step):
        return None

    def data_state(self, step):
        return {"next_step": step}

    def finish(self):
        self.finished += 1
        if self.finish_fails:
            raise OSError(28, "No space left on device")


class Checkpointer:
    enabled, export_at_end = True, False

    def __init__(self, every):
        self.every, self.saved = every, []

    def periodic_due(self, step):
        return step % self.every == 0

    def save(self, step, data_state):
        self.saved.append(step)


def _loop(steps, ckpt):
    rows = []
    ctx = NS(stop=NS(should_stop=lambda device: False), device=torch.device("cpu"), run_dir=None)
    with pytest.raises(RewardsAllFailedError):
        run_loop(ctx, steps, total_steps=100, checkpointer=ckpt,
                 metrics=NS(set_start=lambda s: None, log=lambda split, step, m: rows.append(step)), log_every=1)
    return rows


def test_the_run_saves_the_steps_that_had_a_reward_before_it_stops():
    """Good steps 1-6, checkpoint at 5 (every 5), steps 7-9 without reward: step 6 would be lost -> save at 9."""
    ckpt = Checkpointer(every=5)
    rows = _loop(Steps(bad_from=6, wasted=3), ckpt)
    assert ckpt.saved == [5, 9] and rows[-1] == 9  # the last step's row is logged


def test_no_save_when_only_steps_without_reward_would_be_lost():
    """Checkpoint at 5, steps 5-7 (0-based 4-6) without reward: the checkpoint of step 5 is kept as the resume point."""
    ckpt = Checkpointer(every=5)
    _loop(Steps(bad_from=4, wasted=3), ckpt)
    assert ckpt.saved == [5]


def test_the_run_stopped_for_no_reward_still_finishes_its_steps():
    """`steps.finish()` (the bad-record summary of the whole run; the asynchronous trainer's stop message to its rollout
    ranks) runs before the error is raised, as it does for a run that ends or stops; a failure in it is logged and the
    error the run stopped for is the one raised."""
    steps = Steps(bad_from=2, wasted=2)
    _loop(steps, Checkpointer(every=5))
    assert steps.finished == 1
    steps = Steps(bad_from=2, wasted=2, finish_fails=True)
    _loop(steps, Checkpointer(every=5))  # raises RewardsAllFailedError, not the OSError
    assert steps.finished == 1


def test_a_negative_max_failed_steps_is_refused_naming_the_key():
    from pathlib import Path

    from megatron_vlm.config import ConfigError, load_config

    demo = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_grpo.toml"
    with pytest.raises(ConfigError, match=r"^rl\.reward_pool\.max_failed_steps: must be >= 0 \(0 = never stop\), got -1"):
        load_config(demo, ["rl.reward_pool.max_failed_steps=-1"])
    assert load_config(demo, ["rl.reward_pool.max_failed_steps=0"]).rl.reward_pool.max_failed_steps == 0
