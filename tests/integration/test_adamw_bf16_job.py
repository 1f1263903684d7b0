"""`optimizer.moments_dtype = "bf16"` in a whole SFT job on 2 FSDP ranks (the moments are DTensor shards): the
checkpoint holds the moments in bf16, and a run killed with SIGKILL after its step-2 checkpoint and resumed repeats
the uninterrupted one exactly (the stochastic rounding is seeded by step, so the resumed steps round alike);
`--check` counts 2 bytes per moment."""
from __future__ import annotations

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job, small_demo_overrides

pytestmark = [pytest.mark.distributed]

SETS = {"optimizer.moments_dtype": '"bf16"', "train.max_steps": "4", "checkpoint.every_steps": "2",
        "checkpoint.keep_last": "0", "train.eval_generate": "false"}


def _moment_dtypes(step_dir) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {str(m.properties.dtype) for k, m in meta.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}


def test_bf16_moments_job_saves_bf16_and_resumes_exactly(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    r = run_job(small_demo_overrides(straight, assets, **SETS), nproc=2)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(x["step"]) for x in rows] == [1, 2, 3, 4]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]), [x["loss"] for x in rows]
    assert _moment_dtypes(straight / "checkpoints" / "step_2") == {"torch.bfloat16"}

    r = run_job(small_demo_overrides(crashed, assets, **SETS), nproc=2, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"},
                check=False)
    assert r.returncode != 0, r.stderr[-3000:]
    r = run_job(small_demo_overrides(crashed, assets, **SETS), nproc=2)
    assert "Resumed from checkpoint: step=2" in r.stderr, r.stderr[-3000:]
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows[2:]:
        for key in ("loss", "grad_norm"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
