"""Whole GRPO jobs (in this process) that stop training on nothing: `rl.reward_pool.max_failed_steps` steps in a row
without a usable reward end the run with exit 1 and one line naming the cause and the count.

- a verifier that returns NaN from step 2 on (it used to count as "clipped" and the run went to its end, exit 0):
  steps 2 and 3 have no reward; the run stops after step 3 and saves it first, as step 1 (a good one) would be lost;
- an environment that raises on every call (every trajectory that reaches it "env_error"; it used to only log
  warnings): the run stops after two such steps in a row.
A few seconds each (the parts are in tests/unit/rl/test_no_reward_signal.py)."""
from __future__ import annotations

import signal

import pytest
from jobs import read_metrics
from test_grpo_job import GRPO_DEMO, grpo_overrides
from test_grpo_multiturn import multiturn_overrides

pytestmark = pytest.mark.distributed

SMALL = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1",
         "rl.batch.mini_batches_per_step": "1", "rl.eval.at_start": "false", "checkpoint.every_steps": "100",
         "checkpoint.export_hf": "false", "train.max_steps": "6", "rl.reward_pool.max_failed_steps": "2",
         "rl.reward_pool.workers": "1"}


@pytest.fixture
def run_in_process():
    """runner.run_job here, pytest's stop handlers put back afterwards."""
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield lambda sets: runner.run_job(load_config(GRPO_DEMO, sets))
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_verifier_returning_nan_stops_the_run_and_the_good_step_is_saved(tmp_path, run_in_process, capfd):
    out = tmp_path / "run"
    reward = (f'[{{type = "custom", function = "tests.integration.grpo_stop_fns.nan_after", '
              f'kwargs = {{calls = 16, marker = "{tmp_path / "calls"}"}}}}]')
    code = run_in_process(grpo_overrides(out, tmp_path / "assets", **SMALL, **{"rl.rewards": reward,
                                                                               "rl.accuracy_reward": '"custom"'}))
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert ("error: rl.reward_pool.max_failed_steps: every reward call failed (raised, timed out or returned NaN) in 2 "
            "steps in a row, up to step 3") in err and "NaN" in err.split("last error:")[-1], err[-3000:]
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [float(r["reward/errors"]) for r in rows] == [0.0, 16.0, 32.0]
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_3"]


def test_an_environment_failing_on_every_call_stops_the_run(tmp_path, run_in_process, capfd):
    """Every step the model's turn reaches the environment fails; a trajectory whose first turn ends at a limit
    ("length") never calls it and is trained: such a step has a reward, and only two steps in a row without one stop
    the run."""
    out = tmp_path / "run"
    env = '{name = "tests.integration.grpo_env_fns:AlwaysFails", max_turns = 3, turn_timeout_s = 60.0}'
    code = run_in_process(multiturn_overrides(out, tmp_path / "assets", **SMALL, **{"rl.env": env}))
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    rows = read_metrics(out / "metrics_train.csv")
    last = int(rows[-1]["step"])
    failed = [float(r["env/finish_env_error"]) == 1.0 for r in rows]
    # the first two failed steps in a row end the run (a failed step alone, then one with a reward, did not)
    assert next(i for i in range(1, len(failed)) if failed[i - 1] and failed[i]) == len(failed) - 1, failed
    assert float(rows[-1]["env/errors"]) > 0
    assert ("error: rl.reward_pool.max_failed_steps: every environment episode failed (env_error) in 2 steps in a row, "
            f"up to step {last}") in err and "environment bug" in err, err[-3000:]
    saved = sorted(d.name for d in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
    assert saved == ([f"step_{last}"] if last > 2 else [])  # saved only when steps with a reward would be lost
