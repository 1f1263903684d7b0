"""Two-node rendezvous: train.sbatch's per-node commands, started as two local "nodes", train as one job.

The dry run of a 2-node job (both hosts `localhost`, i.e. 127.0.0.1) prints one command per node;
both are started here at once, as srun would on two machines. They must rendezvous through c10d
on the first node's endpoint, train the demo as one data-parallel job of two ranks, and end with
the parameters of a one-node, one-process run of the same global batch (two micro-batches per
step instead of one per rank; equal up to float summation order, CPU fp32).
"""
from __future__ import annotations

import subprocess

import pytest
from slurm_helpers import TrainJob, assert_same_params, clean_env, dry_run, free_job_id, option, split_node_line

STEPS = 3


@pytest.mark.distributed
@pytest.mark.heavy
def test_two_local_nodes_rendezvous_and_match_one_node(tmp_path, demo_assets):
    two_nodes = tmp_path / "two_nodes"
    job = TrainJob(demo_assets, max_steps=STEPS, output_dir=two_nodes, extra=("train.micro_batches_per_step=1",))
    env = job.env(clean_env(SLURM_JOB_ID=free_job_id(), SLURM_JOB_NAME="twonode", SLURM_NNODES="2",
                            SLURM_JOB_NODELIST="localhost,localhost"))
    lines, _ = dry_run(job.args(), cwd=tmp_path, env=env)
    assert len(lines) == 2
    assert [option(split_node_line(line)[1], "--node_rank") for line in lines] == ["0", "1"]

    # The one-process reference first: it also creates the shared tiny model and data if needed.
    one_node = TrainJob(demo_assets, max_steps=STEPS, extra=("train.micro_batches_per_step=2",))
    one_node.run_direct(tmp_path / "one_node", cwd=tmp_path)

    procs = [subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=job.env(clean_env())) for line in lines]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {rank} exited {p.returncode}:\n{out[-6000:]}"

    assert job.metric_steps(two_nodes) == list(range(1, STEPS + 1))
    assert job.checkpoint_ranks(two_nodes, STEPS) == 2  # both nodes' ranks wrote the final checkpoint
    assert_same_params(job.final_params(two_nodes), one_node.final_params(tmp_path / "one_node"), exact=False)
