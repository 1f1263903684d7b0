"""Two-node rendezvous: train.sbatch's per-node commands, started as two local "nodes", train as one job.

The dry run of a 2-node job (both hosts `localhost`, i.e. 127.0.0.1) prints one command per node;
both are started here at once, as srun would on two machines. They must rendezvous through c10d
on the first node's endpoint, train with world size 2, and end with the parameters of a one-node,
one-process run of the same global batch (equal up to float summation order, CPU fp32).
"""
from __future__ import annotations

import subprocess

import pytest

from slurm_helpers import TrainJob, assert_same_params, clean_env, dry_run, option, split_node_line


@pytest.mark.distributed
def test_two_local_nodes_rendezvous_and_match_one_node(tmp_path):
    job = TrainJob(tmp_path, max_steps=3, global_batch_size=8)
    env = job.env(clean_env(SLURM_JOB_ID="24680", SLURM_JOB_NAME="twonode", SLURM_NNODES="2",
                            SLURM_JOB_NODELIST="localhost,localhost"))
    lines, _ = dry_run([str(job.config)], cwd=tmp_path, env=env)
    assert len(lines) == 2
    assert [option(split_node_line(line)[1], "--node_rank") for line in lines] == ["0", "1"]

    node_env = clean_env()
    procs = [subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=node_env) for line in lines]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {rank} exited {p.returncode}:\n{out}"

    run_dir = tmp_path / "runs" / "twonode-24680"
    rows = (run_dir / "metrics_train.csv").read_text().splitlines()[1:]
    assert [r.split(",")[2] for r in rows] == ["2", "2", "2"]  # both nodes were in the process group

    job.run_direct(tmp_path / "one_node")
    assert_same_params(job.final_params(run_dir), job.final_params(tmp_path / "one_node"), exact=False)
