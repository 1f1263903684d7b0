"""Pipeline parallelism for every family's tiny model, on 2 gloo processes started once: for each family a
dp-only SFT run (2 data-parallel ranks, 1 micro-batch each) and a `parallel.pp=2` run (one pipeline of 2
stages reading the same 2 micro-batches per step, run by the 1F1B schedule) give the same 10 losses and
grad norms (fp32, 1e-5) and the same Hugging Face export (1e-6). Qwen2.5-VL and the text model tie the
embedding to lm_head, which the two stages then both hold (their gradients are summed); Nemotron-VL's
hybrid Mamba2 / MoE blocks are split across the stages, the MoE loads balanced per stage.

In the same workers: the pp=2 run's step-5 checkpoint resumes as a dp-only run (layout change) with the pp
run's last 5 losses and export, and the dp run's step-5 checkpoint resumes as a pp=2 run with the dp run's (the
tied lm_head's optimizer state is stored under the embedding's name only). That each stage holds only its layers is checked in
tests/unit/parallel/test_pipeline_layout.py (no process group needed).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_vlm.data.synthetic_arith import write_synthetic_arith
from megatron_vlm.parallel import init_distributed
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_tp_cp_families import (
    FAMILIES,
    STEPS,
    _assert_same_training,
    _resumes_as_dp,
    _run,
)

pytestmark = [pytest.mark.distributed]


def _families(tmp: Path, rank: int) -> None:
    if rank == 0:
        write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
    init_distributed()
    dist.barrier()
    for family in FAMILIES:
        dp, pp = tmp / family / "dp", tmp / family / "pp"
        resumable = {"checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2} if family == "qwen2_5_vl" else {}
        _run(tmp, family, dp, **{"train.micro_batches_per_step": 1, **resumable})
        _run(tmp, family, pp, **{"parallel.pp": 2, "train.micro_batches_per_step": 2, **resumable})
        if rank == 0:
            _assert_same_training(family, "pp", dp, pp)
        dist.barrier()
    # layout change: the pp=2 checkpoint of step 5 resumes as a dp-only run (2 data-parallel ranks)
    _resumes_as_dp(tmp, rank, "pp")
    # and the reverse: the dp-only checkpoint of step 5 resumes as a pp=2 run
    _resumes_as_dp(tmp, rank, "dp", as_layout={"parallel.pp": 2, "train.micro_batches_per_step": 2})


def test_pp2_matches_dp_for_every_family(tmp_path):
    spawn(tmp_path, _families, init_group=False)  # rank 0 writes the arithmetic data before the rendezvous
