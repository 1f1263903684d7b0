"""Pipeline parallelism with `[lora]` and a micro-batch count the stages do not divide, on 2 gloo processes: the
tiny Qwen2.5-VL (tied embedding / lm_head, so both stages hold it) with adapters on every attention and MLP
projection and its base frozen, `parallel.pp = 2` over 3 micro-batches per step (the 1F1B schedule's warm-up
and cool-down then differ per stage), trains as `parallel.cp = 2` over the same 3 packs per step (one
data-parallel rank each; cp itself equals dp in test_tp_cp_families.py): losses and grad norms (1e-5), the PEFT
adapter and the merged export (1e-6). Heavy: CI keeps the per-family pp = 2 test (test_pp_families.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_vlm.parallel import init_distributed
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_lora_tp import LORA, _adapter, _max_diff
from tests.integration.parallel.test_tp_cp_families import _column, _export, _run

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]


def _runs(tmp: Path, rank: int) -> None:
    init_distributed()
    family = "qwen2_5_vl"
    sets = {**LORA, "train.micro_batches_per_step": 3, "optimizer.lr": 1e-3}
    runs = {layout: tmp / family / layout for layout in ("cp", "pp")}
    for layout, out in runs.items():
        _run(tmp, family, out, **{**sets, f"parallel.{layout}": 2})
    if rank == 0:
        for key in ("loss", "grad_norm"):
            a, b = _column(runs["cp"], key), _column(runs["pp"], key)
            assert len(a) == len(b) == LORA["train.max_steps"] and len(set(a)) > 1, (key, a, b)
            assert max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)) <= 1e-5, (key, a, b)
        diff = _max_diff(_adapter(runs["cp"]), _adapter(runs["pp"]))
        assert diff[0] <= 1e-6, diff
        diff = _max_diff(_export(runs["cp"]), _export(runs["pp"]))
        assert diff[0] <= 1e-6, diff
    dist.barrier()


def test_pp2_lora_over_three_micro_batches_trains_as_cp2(tmp_path):
    spawn(tmp_path, _runs, init_group=False)
