"""A stop signal while a GRPO step hangs in its reward wait, through whole jobs (tiny Qwen2.5-VL, synthetic prompts).

The verifier blocks forever from step 2 on (grpo_stop_fns.block_after); SIGTERM comes once it hangs. The wait used
to notice only at `rl.reward_pool.batch_timeout_s` (300 s by default: longer than the 180 s the shipped sbatch leaves
before SIGKILL); now the job gives the step up within seconds, saves the checkpoint of step 1 (the abandoned step's
prompts are redone) and exits 143, and that checkpoint resumes. One rank in this process (seconds); two synchronous
ranks of which only one hangs (the other waits in the agreement) and asynchronous GRPO (the rollout rank hangs): heavy,
torchrun jobs of ~30 s (tests/unit/rl/test_stop_during_step.py covers their parts in CI, two gloo ranks included).
A held-out evaluation that hangs (after a step, or the final one) is given up the same way: no row of it is logged,
the step is saved and the job exits 143 (seconds, one rank in this process)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from jobs import ENTRY, REPO, free_port, read_metrics
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
BATCH_TIMEOUT_S = 90.0
"""The reward batch deadline of these jobs: before the fix a job waited this long after the signal."""


def _sets(out, marker, *, calls, ranks=(0,), **extra):
    reward = (f'[{{type = "custom", function = "tests.integration.grpo_stop_fns.block_after", '
              f'kwargs = {{calls = {calls}, marker = "{marker}", ranks = {list(ranks)}}}}}]')
    base = {"rl.rewards": reward, "rl.accuracy_reward": '"custom"', "rl.reward_pool.workers": "1",
            "rl.reward_pool.timeout_s": "600.0", "rl.reward_pool.batch_timeout_s": str(BATCH_TIMEOUT_S),
            "rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1",
            "rl.batch.mini_batches_per_step": "1", "rl.eval.at_start": "false", "checkpoint.every_steps": "100",
            "checkpoint.export_hf": "false", "train.max_steps": "3"}
    base.update(extra)
    return grpo_overrides(out, out.parent / "assets", **base)


def _wait_for(path, seconds=400):
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_one_rank_in_process_gives_up_the_hung_step_saves_and_resumes(tmp_path, keep_signal_handlers):
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    out, marker = tmp_path / "run", tmp_path / "hung"
    signalled = {}

    def stop_when_hung():
        _wait_for(marker)
        signalled["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_hung, daemon=True).start()
    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, marker, calls=16)))  # step 1: 4 prompts x 4 samples
    took = time.monotonic() - signalled["at"]
    assert code == 143 and took < 20.0, (code, took)
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_1"]
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file()
    assert [int(r["step"]) for r in read_metrics(out / "metrics_train.csv")] == [1]

    # the verifier fixed: the job resumes at step 1 and redoes step 2
    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, tmp_path / "fixed", calls=10**9)))
    assert code == 0
    assert [int(r["step"]) for r in read_metrics(out / "metrics_train.csv")] == [1, 2, 3]


def _signal_when_hung(marker) -> dict:
    """SIGTERM to this process once the verifier hangs; {"at": the time it was sent}."""
    signalled: dict = {}

    def stop_when_hung():
        _wait_for(marker)
        signalled["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_hung, daemon=True).start()
    return signalled


def _eval_rows(out) -> list[int]:
    path = out / "metrics_eval.csv"
    return [int(r["step"]) for r in read_metrics(path)] if path.is_file() else []


def test_a_hung_held_out_evaluation_is_given_up_the_step_saved_and_resumed(tmp_path, keep_signal_handlers):
    """rl.eval.every_steps = 1: step 1's 16 verifier calls pass, the evaluation after it hangs in its first. Before,
    the evaluation waited out its batch deadline (BATCH_TIMEOUT_S here; 300 s by default, past Slurm's 180 s warning)
    before the loop saw the stop; now it gives up, logs no row of it and step 1 is saved (exit 143)."""
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    out, marker = tmp_path / "run", tmp_path / "hung"
    signalled = _signal_when_hung(marker)
    every = {"rl.eval.every_steps": "1", "train.max_steps": "2"}
    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, marker, calls=16, **every)))
    took = time.monotonic() - signalled["at"]
    assert code == 143 and took < 20.0, (code, took)
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_1"]
    assert [int(r["step"]) for r in read_metrics(out / "metrics_train.csv")] == [1]
    assert _eval_rows(out) == []  # the evaluation given up is not logged (part of its prompts would pass for all)

    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, tmp_path / "fixed", calls=10**9, **every)))
    assert code == 0
    assert [int(r["step"]) for r in read_metrics(out / "metrics_train.csv")] == [1, 2]
    assert _eval_rows(out) == [1, 2]  # the resumed run evaluates step 1, whose evaluation was given up, first


def test_a_hung_final_evaluation_is_given_up_and_redone_by_the_resumed_run(tmp_path, keep_signal_handlers):
    """The evaluation after the last step hangs: it is given up (exit 143, so that the scheduler's requeue runs it);
    the resumed run, at the last step already, evaluates and exits 0."""
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    out, marker = tmp_path / "run", tmp_path / "hung"
    signalled = _signal_when_hung(marker)
    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, marker, calls=16, **{"train.max_steps": "1"})))
    took = time.monotonic() - signalled["at"]
    assert code == 143 and took < 20.0, (code, took)
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file() and _eval_rows(out) == []

    code = runner.run_job(load_config(GRPO_DEMO, _sets(out, tmp_path / "fixed", calls=10**9, **{"train.max_steps": "1"})))
    assert code == 0 and _eval_rows(out) == [1]


def test_a_hung_in_process_environment_call_is_given_up_when_the_job_stops(tmp_path, keep_signal_handlers, caplog):
    """[rl.env] sandbox = false: the environment runs on the rank's main thread. Its first call sleeps 60 s; the stop
    used to be seen only between calls (after the 60 s here, never for a call that hangs for good); now the call is
    interrupted within seconds, step 1 is abandoned (nothing to save before it) and the job exits 143."""
    from test_grpo_multiturn import multiturn_overrides

    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    out, marker = tmp_path / "run", tmp_path / "hung"
    env = (f'{{name = "tests.integration.grpo_stop_fns:HangOnce", kwargs = {{marker = "{marker}"}}, max_turns = 2, '
           'turn_timeout_s = 600.0, sandbox = false}')
    signalled = _signal_when_hung(marker)
    sets = {"rl.env": env, "rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.eval.at_start": "false",
            "checkpoint.export_hf": "false", "train.max_steps": "2"}
    code = runner.run_job(load_config(GRPO_DEMO, multiturn_overrides(out, tmp_path / "assets", **sets)))
    took = time.monotonic() - signalled["at"]
    err = caplog.text
    assert code == 143 and took < 20.0, (code, took, err[-3000:])
    assert "which was abandoned (this rank gave up waiting for its environments: " in err, err[-3000:]


def _torchrun(sets, nproc=2):
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ENTRY), "--config", str(GRPO_DEMO), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _stop_ranks_when_hung(p, marker):
    """SIGTERM to every rank once the verifier hangs (as SLURM signals every task); (stderr, seconds it took)."""
    _wait_for(marker)
    ranks = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]
    assert len(ranks) == 2
    t0 = time.monotonic()
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    _, err = p.communicate(timeout=BATCH_TIMEOUT_S + 200)
    return err, time.monotonic() - t0


@pytest.mark.heavy
def test_two_ranks_agree_to_give_up_the_step_one_of_them_hangs_in(tmp_path):
    """Rank 0's verifier hangs; rank 1 scored its share and waits for rank 0 in the step's agreement."""
    out, marker = tmp_path / "run", tmp_path / "hung"
    p = _torchrun(_sets(out, marker, calls=8, ranks=(0,)))  # step 1: 2 prompts x 4 samples per rank
    err, took = _stop_ranks_when_hung(p, marker)
    assert took < 30.0, (took, err[-3000:])
    assert err.count("exitcode  : 143") >= 1 and "exitcode  : 1 " not in err, err[-3000:]
    assert "which was abandoned" in err and "another rank gave up" in err, err[-3000:]
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file()


@pytest.mark.heavy
def test_asynchronous_rollout_rank_gives_up_the_step_and_the_trainer_saves(tmp_path):
    """The rollout rank (global rank 0) hangs scoring step 2; the trainer waits for step 2's groups."""
    out, marker = tmp_path / "run", tmp_path / "hung"
    p = _torchrun(_sets(out, marker, calls=16, ranks=(0, 1), **{"rl.allocation": '"rollout:1+train:1"'}))
    err, took = _stop_ranks_when_hung(p, marker)
    assert took < 30.0, (took, err[-3000:])
    assert err.count("exitcode  : 143") >= 1 and "exitcode  : 1 " not in err, err[-3000:]
    assert "rollout rank 0 stopped before sending step 2's groups" in err, err[-3000:]
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file()
