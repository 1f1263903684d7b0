"""`parallel.backend = "mcore"` with pipeline parallelism (pp = 2), on 2 gloo processes (one start per test).

Why these runs: with pp > 1 our 1F1B schedule (parallel/pipeline.py) drives stages whose decoder layers are
megatron-core layers (converted before the stage split, each keeping its global layer_number); megatron-core's
own pipeline size stays 1. What could go wrong is what the stage split does to them: the wrong layers held or
stubbed, each stage's HF export converted with another stage's layers (they are stubs there), checkpoint keys
that differ from pp = 1. So (in CI, ~25 s): the tiny Qwen2.5-VL (tied embedding / lm_head held by both stages,
a vision tower on the first) trained with megatron-core layers and pp = 2 gives the native pp = 2 run's losses and
grad norms (1e-5) and HF export (1e-6); its step-2 checkpoint resumes with pp = 1 (2 data-parallel ranks, the
same megatron-core layers) with the uninterrupted run's last losses (1e-5) and export (1e-6).

Heavy (~35 s): the same comparison for the tiny Qwen3-VL-MoE (megatron-core MoELayers, DeepStack on the first
stage) and the Nemotron-VL hybrid (Mamba2 / attention / MLP / MoE blocks as megatron-core layers), split over
the stages, the MoE loads balanced per stage.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("megatron.core")

from tests.integration.parallel.spawn import spawn  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _export, _run  # noqa: E402

pytestmark = [pytest.mark.distributed]

STEPS = 4


def _assert_close_runs(tag: str, a: Path, b: Path, first: int = 0) -> None:
    """Losses and grad norms of run `b` equal run `a`'s from step `first` on (1e-5, relative above 1); exports 1e-6."""
    for key in ("loss", "grad_norm"):
        x, y = _column(a, key)[first:], _column(b, key)
        assert len(x) == len(y) == STEPS - first and len(set(x)) > 1, (tag, key, x, y)
        assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) <= 1e-5, (tag, key, x, y)
    e_a, e_b = _export(a), _export(b)
    assert e_a.keys() == e_b.keys() and e_a, (tag, sorted(set(e_a) ^ set(e_b))[:5])
    diff = max(((e_a[k] - e_b[k]).abs().max().item(), k) for k in e_a)
    assert diff[0] <= 1e-6, (tag, diff)


def _same_pp(tmp: Path, rank: int, family: str, **extra) -> dict[str, Path]:
    runs = {}
    for backend in ("native", "mcore"):
        out = runs[backend] = tmp / family / f"pp_{backend}"
        _run(tmp, family, out, **{"parallel.pp": 2, "parallel.backend": f'"{backend}"',
                                  "train.micro_batches_per_step": 2, "train.max_steps": STEPS, **extra})
    if rank == 0:
        _assert_close_runs(f"{family} pp=2 mcore vs native", runs["native"], runs["mcore"])
    dist.barrier()
    return runs


def _dense_and_resume(tmp: Path, rank: int) -> None:
    ck = {"checkpoint.enable": "true", "checkpoint.every_steps": 2}
    runs = _same_pp(tmp, rank, "qwen2_5_vl", **ck)
    # layout change: the megatron-core pp = 2 checkpoint of step 2 resumes with pp = 1 (2 data-parallel ranks)
    full, resumed = runs["mcore"], tmp / "qwen2_5_vl" / "resumed_pp1"
    if rank == 0:
        shutil.copytree(full / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    dist.barrier()
    _run(tmp, "qwen2_5_vl", resumed, **{"parallel.backend": '"mcore"', "train.micro_batches_per_step": 1,
                                        "train.max_steps": STEPS, **ck, "checkpoint.resume": '"auto"'})
    if rank == 0:
        _assert_close_runs("qwen2_5_vl mcore pp=2 -> pp=1 resume", full, resumed, first=2)


def _moe_and_hybrid(tmp: Path, rank: int) -> None:
    _same_pp(tmp, rank, "qwen3_vl_moe")
    _same_pp(tmp, rank, "nemotron_vl")


@pytest.mark.heavy  # ~16 s; CI keeps tests/unit/mcore/test_mcore_pipeline_stages.py
def test_mcore_pp2_matches_native_pp2_and_resumes_with_pp1(tmp_path):
    spawn(tmp_path, _dense_and_resume)


@pytest.mark.heavy
def test_mcore_pp2_matches_native_pp2_hybrid_moe(tmp_path):
    spawn(tmp_path, _moe_and_hybrid)
