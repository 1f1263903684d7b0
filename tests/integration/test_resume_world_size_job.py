"""Resuming with another number of processes, in every direction the README promises ("other data-parallel,
native tp / cp / pp sizes still resume"): a checkpoint of a 1-process run resumes on 2 data-parallel ranks
(each rank without an `extra_rank<R>.pt` of its own takes rank 0's global state) and on tp = 2; a 2-rank
(dp or tp) checkpoint resumes on 1 process. Each second job continues at step 2 and writes one metrics row per
step. (pp = 2 -> 1: tests/integration/parallel/test_pp_families.py.) Heavy: eight tiny jobs, four of them on
two processes."""
from __future__ import annotations

import pytest
from jobs import read_metrics, run_job, small_demo_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

COMMON = {"checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.export_hf": "false",
          "train.eval_generate": "false", "data.synthetic_eval_size": 4}
DIRECTIONS = {
    "dp1_to_dp2": (1, {}, 2, {}),
    "dp2_to_dp1": (2, {}, 1, {}),
    "tp2_to_dp1": (2, {"parallel.tp": 2}, 1, {}),
    "dp1_to_tp2": (1, {}, 2, {"parallel.tp": 2}),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Where the first job creates the tiny model and synthetic data that the others share."""
    return tmp_path_factory.mktemp("assets")


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_resume_with_another_number_of_processes(tmp_path, assets, direction):
    n1, sets1, n2, sets2 = DIRECTIONS[direction]
    out = tmp_path / "run"
    run_job(small_demo_overrides(out, assets, **{**COMMON, "train.max_steps": 2, **sets1}), nproc=n1)
    r = run_job(small_demo_overrides(out, assets, **{**COMMON, "train.max_steps": 4, **sets2}), nproc=n2)
    assert "Resumed from checkpoint: step=2" in r.stderr, r.stderr[-3000:]
    assert (out / "checkpoints" / "step_4" / "COMPLETE").is_file()
    assert [int(x["step"]) for x in read_metrics(out / "metrics_train.csv")] == [1, 2, 3, 4]
