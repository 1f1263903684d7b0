"""launch/slurm/*.sbatch submitted to a real single-node Slurm cluster started by the test session.

- the demo (launch/configs/demo_sft.toml, shrunk with --set) completes through sbatch and leaves
  checkpoints, metrics, config, export and logs in its folders;
- a job signalled with TERM mid-run (what `--signal=B:TERM@<s>` does before the time limit)
  saves a checkpoint, requeues itself into the same run folder, resumes, and ends with exactly
  the parameters of the uninterrupted run (CPU, fp32);
- a plain `scancel` stops the job without requeueing it;
- bench_kernels.sbatch runs every benchmark and collects their output, failures included.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from slurm_helpers import BENCH_SBATCH, DEMO, TRAIN_SBATCH, TrainJob, assert_same_params, clean_env, wait_for

STEPS = 20  # long enough that TERM after step 1 lands mid-run even on a fast machine


def submit(cluster, job: TrainJob, cwd, *, name: str) -> int:
    env = job.env(cluster.env(**{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")}))
    return cluster.sbatch(["-J", name, str(TRAIN_SBATCH), *job.args()], cwd=cwd, env=env)


def config_without_output_dir(folder):
    """The demo config minus its fixed `output_dir`, so that the job gets runs/<name>-<id>/."""
    text = DEMO.read_text()
    assert re.search(r'^output_dir = "runs/demo_sft"$', text, flags=re.M)
    path = folder / "demo_own_folder.toml"
    path.write_text(re.sub(r"^output_dir = .*\n", "", text, flags=re.M))
    return path


@pytest.fixture(scope="module")
def short_run(slurm_cluster, demo_assets, tmp_path_factory):
    """The demo, uninterrupted, through sbatch: checked by itself, and the reference for resume."""
    folder = tmp_path_factory.mktemp("short")
    job = TrainJob(demo_assets, max_steps=STEPS, every_steps=5)
    job_id = submit(slurm_cluster, job, folder, name="short")
    info = slurm_cluster.wait_job(job_id, timeout=300)
    return job, job_id, folder, info


def test_demo_short_run_leaves_checkpoint_logs_and_metrics(short_run):
    job, job_id, folder, info = short_run
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0"

    run_dir = folder / "runs" / "demo_sft"  # the demo config's own output_dir, under the submit folder
    assert job.checkpoint_steps(run_dir) == [5, 10, 15, STEPS]
    assert job.metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "hf" / "config.json").is_file()
    log_dir = run_dir / "logs" / f"short-{job_id}"
    assert f"step {STEPS}/{STEPS}" in (log_dir / "node0.log").read_text()
    assert (log_dir / "batch.log").resolve() == folder / f"slurm-short-{job_id}.out"
    launch = (log_dir / "launch.log").read_text()
    assert f"--rdzv_id {job_id}" in launch and "--node_rank 0" in launch
    assert "1 node(s) x 1 process(es)" in (log_dir / "batch.log").read_text()


@pytest.mark.slow
def test_term_mid_run_checkpoints_requeues_and_resumes_exactly(tmp_path, slurm_cluster, short_run, demo_assets):
    reference, _, ref_folder, _ = short_run
    job = TrainJob(demo_assets, max_steps=STEPS, every_steps=5, config=config_without_output_dir(tmp_path))
    job_id = submit(slurm_cluster, job, tmp_path, name="preempt")
    run_dir = tmp_path / "runs" / f"preempt-{job_id}"
    wait_for(lambda: job.metric_steps(run_dir), 240, "the first training step")
    # What Slurm does `--signal=B:TERM@<s>` before the time limit: TERM to the batch shell only.
    slurm_cluster.run(["scancel", "--batch", "--signal=TERM", str(job_id)])

    wait_for(lambda: slurm_cluster.job(job_id)["Restarts"] == "1", 90, "the job to be requeued")
    info = slurm_cluster.wait_job(job_id, timeout=300)
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0"

    node_log = (run_dir / "logs" / f"preempt-{job_id}" / "node0.log").read_text()
    saved = int(re.search(r"stop signal received: saving a checkpoint at step (\d+)", node_log).group(1))
    assert 1 <= saved < STEPS
    assert f"Resumed from checkpoint: step={saved}" in node_log
    assert saved in job.checkpoint_steps(run_dir) and job.checkpoint_steps(run_dir)[-1] == STEPS
    # every step trained exactly once across the two allocations
    assert job.metric_steps(run_dir) == list(range(1, STEPS + 1))
    batch_log = (tmp_path / f"slurm-preempt-{job_id}.out").read_text()
    assert "requeueing job" in batch_log and "restart 1" in batch_log

    assert_same_params(job.final_params(run_dir), reference.final_params(ref_folder / "runs" / "demo_sft"), exact=True)


SLEEPER = """\
import os, signal, sys, time
ALLOCATION = os.environ.get("SLURM_RESTART_COUNT", "0")
def on_term(*_):
    print(f"sleeper got TERM (restart {ALLOCATION})", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print(f"sleeper started (restart {ALLOCATION})", flush=True)
time.sleep(120)  # bounded, in case a test dies without cancelling it
"""


def submit_sleeper(cluster, folder, name: str, *sbatch_args: str, wait_started: bool = True) -> tuple[int, Path]:
    """train.sbatch with a "trainer" that only sleeps and exits on TERM: for the launcher's own decisions.
    `wait_started`: return once the sleeper runs (else at once: a job that Slurm signals before the sleeper is
    up requeues without ever launching it, so the sleeper may never start)."""
    (folder / "sleeper.py").write_text(SLEEPER)
    (folder / "job.toml").write_text("[train]\n")
    env = cluster.env(ENTRY_POINT=str(folder / "sleeper.py"),
                      **{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")})
    job_id = cluster.sbatch(["-J", name, *sbatch_args, str(TRAIN_SBATCH), "job.toml"], cwd=folder, env=env)
    node_log = folder / "runs" / f"{name}-{job_id}" / "logs" / f"{name}-{job_id}" / "node0.log"
    if wait_started:
        wait_for(lambda: node_log.is_file() and "sleeper started" in node_log.read_text(), 120, "the sleeper to start")
    return job_id, node_log


@pytest.mark.heavy  # ~22 s; CI keeps the SIGTERM mid-run requeue test
@pytest.mark.slow
def test_header_signal_before_the_time_limit_requeues(tmp_path, slurm_cluster):
    # A 3-minute limit is shorter than the header's `--signal=B:TERM@180` lead time, so Slurm sends
    # the warning at its first periodic check (within ~30 s) instead of minutes later.
    # The warning may come before the sleeper is up (a loaded machine): do not wait for it to start.
    job_id, node_log = submit_sleeper(slurm_cluster, tmp_path, "limit", "--time=3", wait_started=False)
    wait_for(lambda: slurm_cluster.job(job_id)["Restarts"] == "1", 120, "the job to be requeued")
    slurm_cluster.run(["scancel", str(job_id)])
    batch_log = (tmp_path / f"slurm-limit-{job_id}.out").read_text()
    assert "SIGTERM (job state RUNNING)" in batch_log and "requeue=1" in batch_log
    assert "requeueing job" in batch_log
    # Slurm's periodic time-limit check may fire while the batch shell is still starting (a loaded
    # machine): then the first allocation requeues without launching, which the log must say.
    # Either way, a sleeper that was running when the warning came must have got the TERM.
    first_allocation = batch_log.split("(restart 1)")[0]
    if node_log.is_file() and "sleeper started (restart 0)" in node_log.read_text():
        assert "sleeper got TERM (restart 0)" in node_log.read_text()  # forwarded to Python under torchrun
    else:  # the warning came before the sleeper (or torchrun) was up
        assert "not launching it" in first_allocation or "training step exited" in first_allocation


USR1_SLEEPER = """\
import signal, sys, time
def on_usr1(*_):
    print("sleeper got USR1, saving", flush=True)
    time.sleep(6)  # a checkpoint being written
    print("sleeper saved", flush=True)
    sys.exit(143)
signal.signal(signal.SIGUSR1, on_usr1)
print("sleeper started", flush=True)
time.sleep(120)
"""


def test_usr1_to_the_step_reaches_the_ranks_and_the_step_waits_for_their_checkpoint(tmp_path, slurm_cluster):
    """`scancel --signal=USR1` (and `--signal=USR1@<s>`) signals every process of the step. torchrun does not handle
    USR1 by default and died of it at once, ending the step while the ranks were still saving (and on a cgroup
    cluster killing them): the script makes torchrun forward USR1 to its ranks and wait for them, as it does TERM."""
    (tmp_path / "sleeper.py").write_text(USR1_SLEEPER)
    (tmp_path / "job.toml").write_text("[train]\n")
    env = slurm_cluster.env(ENTRY_POINT=str(tmp_path / "sleeper.py"),
                            **{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")})
    job_id = slurm_cluster.sbatch(["-J", "usr1", str(TRAIN_SBATCH), "job.toml"], cwd=tmp_path, env=env)
    node_log = tmp_path / "runs" / f"usr1-{job_id}" / "logs" / f"usr1-{job_id}" / "node0.log"
    wait_for(lambda: node_log.is_file() and "sleeper started" in node_log.read_text(), 120, "the sleeper to start")
    slurm_cluster.run(["scancel", "--signal=USR1", str(job_id)])
    slurm_cluster.wait_job(job_id, states=("FAILED", "COMPLETED"), timeout=90)
    # read at once: when the step ended the rank had finished its checkpoint
    assert "sleeper saved" in node_log.read_text(), node_log.read_text()
    batch_log = (tmp_path / f"slurm-usr1-{job_id}.out").read_text()
    assert "User defined signal 1" not in batch_log and "requeue" not in batch_log, batch_log


FINISHING_SLEEPER = """\
import signal, sys, time
from pathlib import Path
RUN_DIR = next(a.split("=", 1)[1].strip('"') for a in sys.argv if a.startswith("train.output_dir="))
def on_term(*_):
    print("sleeper got TERM after its last step: finishing the evaluation", flush=True)
    time.sleep(3)
    Path(RUN_DIR, "finished").write_text("the job finished (exit 0)\\n")  # what megatron_vlm/runner.py leaves
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("sleeper started", flush=True)
time.sleep(120)
"""


def test_a_run_that_finishes_after_the_term_is_not_requeued(tmp_path, slurm_cluster):
    """TERM during the final evaluation / export: the ranks finish and exit 0 (torchrun, signalled too, exits 1
    anyway). The job was requeued all the same, and the next allocation resumed at the last step only to evaluate
    and export again: the script reads the run folder's `finished` file and ends the job instead."""
    (tmp_path / "sleeper.py").write_text(FINISHING_SLEEPER)
    (tmp_path / "job.toml").write_text("[train]\n")
    env = slurm_cluster.env(ENTRY_POINT=str(tmp_path / "sleeper.py"),
                            **{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")})
    job_id = slurm_cluster.sbatch(["-J", "done", str(TRAIN_SBATCH), "job.toml"], cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"done-{job_id}"
    node_log = run_dir / "logs" / f"done-{job_id}" / "node0.log"
    wait_for(lambda: node_log.is_file() and "sleeper started" in node_log.read_text(), 120, "the sleeper to start")
    slurm_cluster.run(["scancel", "--batch", "--signal=TERM", str(job_id)])
    try:  # PENDING: requeued (the defect)
        info = slurm_cluster.wait_job(job_id, states=("COMPLETED", "FAILED", "PENDING", "REQUEUED"), timeout=90)
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    batch_log = (tmp_path / f"slurm-done-{job_id}.out").read_text()
    assert "requeue=1" in batch_log and "requeueing job" not in batch_log, batch_log
    assert "not requeueing" in batch_log
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0" and info["ExitCode"] == "0:0", info


def test_plain_scancel_is_not_requeued(tmp_path, slurm_cluster):
    job_id, _ = submit_sleeper(slurm_cluster, tmp_path, "cancel")
    slurm_cluster.run(["scancel", str(job_id)])
    slurm_cluster.wait_job(job_id, states=("CANCELLED",), timeout=90)
    wait_for(lambda: "requeue=0" in (tmp_path / f"slurm-cancel-{job_id}.out").read_text(), 30, "the TERM log line")
    info = slurm_cluster.job(job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0"


def test_bench_kernels_collects_every_result(tmp_path, slurm_cluster):
    bench = tmp_path / "benches"
    bench.mkdir()
    (bench / "bench_ok.py").write_text("import sys\nprint('ratio 1.25x', sys.argv[1:])\n")
    (bench / "bench_broken.py").write_text("raise SystemExit('no device')\n")
    env = slurm_cluster.env(BENCH_DIR=str(bench), PYTHON=clean_env()["PYTHON"])
    job_id = slurm_cluster.sbatch([str(BENCH_SBATCH), "--quick"], cwd=tmp_path, env=env)
    info = slurm_cluster.wait_job(job_id, states=("FAILED",), timeout=60)  # one benchmark failed
    assert info["ExitCode"] == "1:0"

    out = tmp_path / "runs" / f"bench-kernels-{job_id}"
    assert (out / "bench_ok.log").read_text() == f"ratio 1.25x ['--quick', '--json', '{out / 'bench_ok.json'}']\n"
    assert "no device" in (out / "bench_broken.log").read_text()
    rows = [line.split("\t")[:2] for line in (out / "summary.tsv").read_text().splitlines()]
    assert rows == [["benchmark", "exit_status"], ["bench_broken", "1"], ["bench_ok", "0"]]
    results = (out / "results.md").read_text()
    assert "## bench_ok" in results and "ratio 1.25x" in results and "torch:" in results
