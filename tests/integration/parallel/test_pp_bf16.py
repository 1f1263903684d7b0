"""`parallel.pp = 2` with `train.precision = "bf16"` on Nemotron-VL, whose vision path casts the pixels to
lm_head's dtype: before the last stage lm_head is a stub, which kept the fp32 master dtype while FSDP ran the
vision tower in bf16 ("expected m1 and m2 to have the same dtype", a traceback at the first step). Reference:
the same 2 steps with dp = 2 (the same micro-batches per step), losses within bf16 rounding."""
from __future__ import annotations

import math

import pytest
from jobs import read_metrics, run_job, small_demo_overrides

pytestmark = pytest.mark.distributed


@pytest.mark.heavy  # ~15 s; CI keeps the fp32 pp = 2 family test
def test_pp2_bf16_nemotron_vl_trains_like_dp2(tmp_path):
    assets = tmp_path / "assets"
    common = {"model.synthesize": '"tiny_nemotron_vl"', "train.train_layers": "[]", "train.precision": '"bf16"',
              "train.max_steps": "2", "data.synthetic_eval_size": "0", "checkpoint.every_steps": "0",
              "checkpoint.export_hf": "false"}
    losses = {}
    for name, extra in (("dp2", {}), ("pp2", {"parallel.pp": "2", "train.micro_batches_per_step": "2"})):
        out = tmp_path / name
        run_job(small_demo_overrides(out, assets, **common, **extra), nproc=2, timeout=300)
        losses[name] = [float(r["loss"]) for r in read_metrics(out / "metrics_train.csv")]
    assert len(losses["pp2"]) == 2 and all(math.isfinite(x) for x in losses["pp2"])
    for a, b in zip(losses["dp2"], losses["pp2"]):
        assert b == pytest.approx(a, rel=2e-2), losses
