"""Asynchronous GRPO through the entry point: one rollout rank + one training rank (2 processes, gloo,
tiny random Qwen2.5-VL, synthetic VQA prompts).

- max_head_offpolicyness = 0 repeats the synchronous loop (one process, an inference copy refreshed
  every step): the same rewards, losses and gradient norms at every step — and it still does after
  the training rank is killed with SIGKILL before step 3 and the job is resumed from its step-2
  checkpoint (the rollout in flight is dropped and generated again; marked heavy: three jobs);
- max_head_offpolicyness = 2: the rollout runs ahead (samples up to 2 versions old arrive), the
  trainer's per-token check never fires, and the decoupled loss reports its importance weights
  (heavy, like the SIGTERM run: CI runs the k = 0 comparison, ~45 s, and tests/unit/rl/test_async_*.py);
- a resume past `train.max_steps` exits 2 on both ranks with the one line, before any weight push (heavy).
"""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
COMPARED = ("reward/mean", "loss", "grad_norm", "response_length/mean", "advantage/std")


def _tiny(out, assets, **extra):
    base = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "2",
            "rl.eval.at_start": "false", "train.max_steps": "4", "checkpoint.export_hf": "false", "rl.reward_pool.workers": "1"}
    base.update(extra)
    return grpo_overrides(out, assets, **base)


def _sync_reference(tmp_path, assets, steps):
    out = tmp_path / "sync"
    run_job(_tiny(out, assets, **{"rl.rollout.weights": '"copy"', "train.max_steps": str(steps)}), config=GRPO_DEMO)
    want = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in want] == list(range(1, 1 + steps)) and float(want[0]["grad_norm"]) > 0
    return want


def _assert_same(got_rows, want):
    got = {int(x["step"]): x for x in got_rows}
    assert sorted(got) == [int(r["step"]) for r in want]
    for row in want:
        step = int(row["step"])
        for key in COMPARED:
            assert float(got[step][key]) == float(row[key]), (step, key, got[step][key], row[key])
        assert float(got[step]["async/version_lag_max"]) == 0.0


def test_offpolicyness_0_equals_sync(tmp_path):
    assets = tmp_path / "assets"
    want = _sync_reference(tmp_path, assets, 3)
    out = tmp_path / "async"
    run_job(_tiny(out, assets, **{"rl.allocation": '"rollout:1+train:1"', "checkpoint.enable": "false",
                                  "train.max_steps": "3"}), nproc=2,
            config=GRPO_DEMO)
    _assert_same(read_metrics(out / "metrics_train.csv"), want)


@pytest.mark.heavy  # 3 jobs; CI runs the uninterrupted comparison above and the synchronous kill -9 test
def test_kill9_of_the_training_rank_and_resume_equals_sync(tmp_path):
    assets = tmp_path / "assets"
    want = _sync_reference(tmp_path, assets, 4)
    crashed = tmp_path / "async"
    async_sets = _tiny(crashed, assets, **{"rl.allocation": '"rollout:1+train:1"'})
    r = run_job(async_sets, nproc=2, config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False)
    assert r.returncode != 0, r.stderr[-3000:]
    assert (crashed / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert not (crashed / "checkpoints" / "step_4").exists()
    r = run_job(async_sets, nproc=2, config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    _assert_same(read_metrics(crashed / "metrics_train.csv"), want)


@pytest.mark.heavy  # over the CI time budget; CI keeps the comparison above and the unit tests of the check
def test_bounded_staleness_and_decoupled_loss(tmp_path):
    out = tmp_path / "run"
    sets = _tiny(out, tmp_path / "assets", **{"rl.allocation": '"rollout:1+train:1"', "rl.asynchronous.max_head_offpolicyness": "2",
                                               "rl.loss.behav_imp_weight_cap": "5.0", "train.max_steps": "4",
                                               "checkpoint.enable": "false", "rl.eval.every_steps": "0"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    lags = [float(r["async/version_lag_max"]) for r in rows]
    assert max(lags) <= 2 and max(lags) > 0, lags  # ran ahead, never beyond the bound
    for r in rows:
        w = float(r["actor/behav_imp_weight"])
        assert w == w and w > 0 and 0 <= float(r["async/trainer_idle_frac"]) <= 1
        assert 0 <= float(r["async/rollout_idle_frac"]) <= 1


@pytest.mark.heavy  # one more job; the synchronous SIGTERM path is tested in CI
def test_sigterm_saves_and_every_rank_exits_143(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from jobs import ENTRY, free_port

    out = tmp_path / "run"
    sets = _tiny(out, tmp_path / "assets", **{"rl.allocation": '"rollout:1+train:1"', "rl.asynchronous.max_head_offpolicyness": "1",
                                               "train.max_steps": "200", "checkpoint.every_steps": "1000"})
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ENTRY), "--config", str(GRPO_DEMO), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    csv_path = out / "metrics_train.csv"
    deadline = time.time() + 400
    while time.time() < deadline and (not csv_path.is_file() or len(read_metrics(csv_path)) < 2):
        time.sleep(1)
    ranks = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]
    assert len(ranks) == 2
    for pid in ranks:  # both ranks, as SLURM signals every task (torchrun would only forward it)
        os.kill(pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    # torchrun reports the failed ranks; both stopped with 143, none with another code
    assert p.returncode != 0 and err.count("exitcode  : 143") >= 1 and "exitcode  : 1 " not in err, err[-3000:]
    assert "stop signal received: saving a checkpoint" in err
    saved = [d.name for d in (out / "checkpoints").iterdir() if (d / "COMPLETE").is_file()]
    assert saved, err[-3000:]


@pytest.mark.heavy  # 3 processes (two training ranks in a tp or cp group) and the synchronous reference
@pytest.mark.parametrize("key", ["parallel.tp", "parallel.cp"])
def test_tensor_or_context_parallel_training_ranks_train_like_one(tmp_path, key):
    """Two training ranks of one tp (or cp) group train on the same groups: the step of one training rank, up to float
    rounding (the groups were dealt by training rank, the two ranks' forwards then mismatched: a gloo size error)."""
    assets = tmp_path / "assets"
    want = _sync_reference(tmp_path, assets, 2)
    out = tmp_path / "async"
    run_job(_tiny(out, assets, **{"rl.allocation": '"rollout:1+train:2"', key: "2", "checkpoint.enable": "false",
                                  "train.max_steps": "2"}), nproc=3, config=GRPO_DEMO)
    got = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in got] == [1, 2]
    assert float(got[0]["reward/mean"]) == float(want[0]["reward/mean"])  # the rollout rank's samples of step 1
    for g, w in zip(got, want):
        for name in COMPARED:
            assert float(g[name]) == pytest.approx(float(w[name]), rel=1e-3, abs=1e-5), (g["step"], name)


@pytest.mark.heavy  # 2 jobs; CI runs tests/unit/rl/test_async_resume_refusal.py (the trainer's and a rollout rank's side)
def test_a_resume_past_the_end_exits_2_on_every_rank_before_the_weight_push(tmp_path):
    assets = tmp_path / "assets"
    out = tmp_path / "async"
    sets = _tiny(out, assets, **{"rl.allocation": '"rollout:1+train:1"', "train.max_steps": "2",
                                 "checkpoint.every_steps": "2"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    r = run_job([*sets, "train.max_steps=1"], nproc=2, config=GRPO_DEMO, check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("config error:")]
    # the training rank and the rollout rank both exit 2 (torchrun itself exits 1 when a rank fails)
    assert r.returncode != 0 and len(errors) == 2 and "exitcode  : 1 " not in r.stderr, r.stderr[-3000:]
    assert all(e.startswith("config error: train.max_steps: the checkpoint resumed is at step 2, past this run's 1")
               for e in errors), errors
    assert "weights of step 2 pushed" not in r.stderr
