"""`parallel.fsdp = false` in bf16 (one process, bf16 weights, fp32 masters in the optimizer) against the same job
under torch's FSDP2 mixed precision on one rank, the reference: the logged losses and gradient norms over steps of
two micro-batches and the exported weights are the same bit for bit; the checkpoint holds the fp32 masters (not the
bf16 weights), so a checkpoint of the FSDP2 run resumes into the no-FSDP layout and repeats the FSDP2 run's
remaining steps exactly; a refused layout exits 2 naming the key."""
from __future__ import annotations

import shutil

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job, run_job_here, small_demo_overrides

SETS = {"train.precision": '"bf16"', "train.micro_batches_per_step": "2", "train.eval_generate": "false",
        "checkpoint.every_steps": "2", "checkpoint.keep_last": "0"}


def _weight_dtypes(step_dir) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {str(m.properties.dtype) for k, m in meta.items() if k.startswith("model.") and k.endswith(".weight")}


def _rows(run) -> dict:
    return {int(x["step"]): (float(x["loss"]), float(x["grad_norm"])) for x in read_metrics(run / "metrics_train.csv")}


def test_no_fsdp_job_is_fsdp2_mixed_precision_bitwise(tmp_path):
    assets = tmp_path / "assets"
    fsdp, plain, resumed = tmp_path / "fsdp", tmp_path / "plain", tmp_path / "resumed"
    run_job_here(small_demo_overrides(fsdp, assets, **SETS))
    r = run_job_here(small_demo_overrides(plain, assets, **SETS, **{"parallel.fsdp": "false"}))
    assert "parallel.fsdp = false" in r.stderr
    a, b = _rows(fsdp), _rows(plain)
    assert sorted(a) == [1, 2, 3, 4] and a == b, (a, b)
    assert b[4][0] < b[1][0]
    assert _weight_dtypes(plain / "checkpoints" / "step_2") == {"torch.float32"}  # the masters, not bf16
    ea, eb = load_safetensors_dir(fsdp / "hf"), load_safetensors_dir(plain / "hf")
    assert ea.keys() == eb.keys() and all((ea[k] == eb[k]).all() for k in ea)

    # the FSDP2 run's step-2 checkpoint, resumed without FSDP2: steps 3-4 as the FSDP2 run made them
    shutil.copytree(fsdp / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    r = run_job_here(small_demo_overrides(resumed, assets, **{**SETS, "parallel.fsdp": "false"}))
    assert "Resumed from checkpoint: step=2" in r.stderr, r.stderr[-3000:]
    c = _rows(resumed)
    assert {s: c[s] for s in (3, 4)} == {s: a[s] for s in (3, 4)}, (c, a)


def test_no_fsdp_refused_with_parallelism(tmp_path):
    r = run_job(small_demo_overrides(tmp_path / "x", tmp_path / "assets", **{"parallel.fsdp": "false", "parallel.tp": "2"}),
                check=False)
    assert r.returncode == 2 and "parallel.fsdp" in r.stderr, r.stderr[-2000:]


def test_no_fsdp_fp8_job_is_fsdp2_bitwise(tmp_path):
    """train.precision = "fp8" (torchao's float8 linears, emulated on the CPU) over bf16 weights: as under FSDP2."""
    pytest.importorskip("torchao")
    assets, sets = tmp_path / "assets", {"train.precision": '"fp8"', "train.eval_generate": "false", "train.max_steps": "3"}
    run_job_here(small_demo_overrides(tmp_path / "fsdp", assets, **sets))
    run_job_here(small_demo_overrides(tmp_path / "plain", assets, **sets, **{"parallel.fsdp": "false"}))
    a, b = _rows(tmp_path / "fsdp"), _rows(tmp_path / "plain")
    assert sorted(a) == [1, 2, 3] and a == b, (a, b)


def test_no_fsdp_grpo_decodes_with_the_trainer_weights_as_fsdp2_shared(tmp_path):
    """GRPO with rl.rollout.weights = "shared" and no FSDP2: the engine decodes with the trainer's bf16 weights as its
    own copy (continuous batching, no FSDP root to call); rollouts, rewards and updates over 4 steps are those of the
    FSDP2 run's lock-step shared engine, bit for bit."""
    from test_grpo_job import GRPO_DEMO, grpo_overrides

    assets, sets = tmp_path / "assets", {"train.precision": '"bf16"', "checkpoint.every_steps": "0"}
    run_job_here(grpo_overrides(tmp_path / "fsdp", assets, **sets), config=GRPO_DEMO)
    r = run_job_here(grpo_overrides(tmp_path / "plain", assets, **sets, **{"parallel.fsdp": "false"}), config=GRPO_DEMO)
    assert "decodes with the trainer's bf16 weights in place" in r.stderr
    keys = ("loss", "reward/mean", "grad_norm", "response_length/mean")
    a, b = ([{k: x.get(k) for k in keys} for x in read_metrics(tmp_path / run / "metrics_train.csv")] for run in ("fsdp", "plain"))
    assert len(a) == 4 and a == b, (a, b)
    assert len({row["reward/mean"] for row in a}) > 1  # the updates changed what was generated
