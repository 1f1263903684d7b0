"""launch/slurm/*.sbatch submitted to a real single-node Slurm cluster started by the test session.

- a short training job completes and leaves checkpoint, metrics, config and logs in its folders;
- a job signalled with TERM mid-run (what `--signal=B:TERM@<s>` does before the time limit)
  saves a checkpoint, requeues itself, resumes, and ends with exactly the parameters of a run that
  was never interrupted (CPU, fp32);
- a plain `scancel` stops the job without requeueing it;
- bench_kernels.sbatch runs every benchmark and collects their output, failures included.
"""
from __future__ import annotations

import re

import pytest

from slurm_helpers import BENCH_SBATCH, TRAIN_SBATCH, TrainJob, assert_same_params, clean_env, wait_for


def submit(cluster, job: TrainJob, cwd, *args: str, name: str) -> int:
    env = job.env(cluster.env(**{k: v for k, v in clean_env().items() if k in ("TORCHRUN", "PYTHON")}))
    return cluster.sbatch(["-J", name, str(TRAIN_SBATCH), str(job.config), *args], cwd=cwd, env=env)


STEPS = 8


@pytest.fixture(scope="module")
def short_run(slurm_cluster, tmp_path_factory):
    """One uninterrupted short job through sbatch: checked by itself, and the reference for resume."""
    folder = tmp_path_factory.mktemp("short")
    job = TrainJob(folder, max_steps=STEPS)
    job_id = submit(slurm_cluster, job, folder, "--set", "checkpoint.every_steps=4", name="short")
    info = slurm_cluster.wait_job(job_id, timeout=150)
    return job, job_id, folder, info


def test_short_run_leaves_checkpoint_logs_and_metrics(short_run):
    job, job_id, folder, info = short_run
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0"

    run_dir = folder / "runs" / f"short-{job_id}"
    assert job.checkpoint_steps(run_dir) == [4, STEPS]
    assert job.metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert (run_dir / "config.toml").is_file()
    log_dir = run_dir / "logs" / f"short-{job_id}"
    assert f"step {STEPS}/{STEPS}" in (log_dir / "node0.log").read_text()
    assert (log_dir / "batch.log").resolve() == folder / f"slurm-short-{job_id}.out"
    launch = (log_dir / "launch.log").read_text()
    assert f"--rdzv_id {job_id}" in launch and "--node_rank 0" in launch
    assert "1 node(s) x 1 process(es)" in (log_dir / "batch.log").read_text()


@pytest.mark.slow
def test_term_mid_run_checkpoints_requeues_and_resumes_exactly(tmp_path, slurm_cluster, short_run):
    reference, ref_id, ref_folder, _ = short_run
    job = TrainJob(tmp_path, max_steps=STEPS, step_seconds=0.7)  # slower steps, same arithmetic
    job_id = submit(slurm_cluster, job, tmp_path, "--set", "checkpoint.every_steps=4", name="preempt")
    run_dir = tmp_path / "runs" / f"preempt-{job_id}"
    wait_for(lambda: (run_dir / "metrics_train.csv").is_file() and len(job.metric_steps(run_dir)) >= 1,
             120, "the first training step")
    # What Slurm does `--signal=B:TERM@<s>` before the time limit: TERM to the batch shell only.
    slurm_cluster.run(["scancel", "--batch", "--signal=TERM", str(job_id)])

    wait_for(lambda: slurm_cluster.job(job_id)["Restarts"] == "1", 60, "the job to be requeued")
    info = slurm_cluster.wait_job(job_id, timeout=150)
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

    assert_same_params(job.final_params(run_dir), reference.final_params(ref_folder / "runs" / f"short-{ref_id}"),
                       exact=True)


def test_plain_scancel_is_not_requeued(tmp_path, slurm_cluster):
    job = TrainJob(tmp_path, max_steps=50, step_seconds=0.5)
    job_id = submit(slurm_cluster, job, tmp_path, name="cancel")
    run_dir = tmp_path / "runs" / f"cancel-{job_id}"
    wait_for(lambda: (run_dir / "metrics_train.csv").is_file(), 120, "the first training step")
    slurm_cluster.run(["scancel", str(job_id)])
    info = slurm_cluster.wait_job(job_id, states=("CANCELLED",), timeout=60)
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
    assert (out / "bench_ok.log").read_text() == "ratio 1.25x ['--quick']\n"
    assert "no device" in (out / "bench_broken.log").read_text()
    rows = [line.split("\t")[:2] for line in (out / "summary.tsv").read_text().splitlines()]
    assert rows == [["benchmark", "exit_status"], ["bench_broken", "1"], ["bench_ok", "0"]]
    results = (out / "results.md").read_text()
    assert "## bench_ok" in results and "ratio 1.25x" in results and "torch:" in results
