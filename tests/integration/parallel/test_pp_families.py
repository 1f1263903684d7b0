"""Pipeline parallelism for every family's tiny model, on 2 gloo processes started once: for each family a
dp-only SFT run (2 data-parallel ranks, 1 micro-batch each) and a `parallel.pp=2` run (one pipeline of 2
stages reading the same 2 micro-batches per step, run by the 1F1B schedule) give the same 10 losses and
grad norms (fp32, 1e-5) and the same Hugging Face export (1e-6). Qwen2.5-VL and the text model tie the
embedding to lm_head, which the two stages then both hold (their gradients are summed); Nemotron-VL's
hybrid Mamba2 / MoE blocks are split across the stages, the MoE loads balanced per stage. The MoE families
report their expert loads every step (`[moe]` set, a Mamba2 kernel forced), though their second stage holds no
MoE (or Mamba2) layer, and so does a tiny 3-layer Qwen3-MoE text model with a MoE layer on each stage: the pp run's
`moe/*` metrics and per-layer expert-load table (rank 0 writes them) are the dp run's, every stage's layers. With
a stand-in peak both runs log `mfu` on the CPU, from the whole model's parameter count (not rank 0's stage's).

In the same workers: the pp=2 run's step-5 checkpoint resumes as a dp-only run (layout change) with the pp
run's last 5 losses and export, and the dp run's step-5 checkpoint resumes as a pp=2 run with the dp run's (the
tied lm_head's optimizer state is stored under the embedding's name only). That each stage holds only its layers is checked in
tests/unit/parallel/test_pipeline_layout.py (no process group needed).
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_vlm.config import load_config
from megatron_vlm.data.synthetic_arith import write_synthetic_arith
from megatron_vlm.jobs import run_kind
from megatron_vlm.parallel import init_distributed
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
from megatron_vlm.training import sft
from megatron_vlm.training.context import RunContext
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_tp_cp_families import (
    CONFIGS,
    FAMILIES,
    STEPS,
    _assert_same_training,
    _column,
    _resumes_as_dp,
    _run,
)

pytestmark = [pytest.mark.distributed]


PEAK = 1e12


def _num_params(tmp: Path, family: str) -> float:
    from megatron_vlm.checkpoint.hf import load_hf_model
    return float(sum(p.numel() for p in load_hf_model(str(tmp / family / "model")).parameters()))


MOE_FAMILIES = ("qwen3_vl_moe", "nemotron_vl")
MOE_METRICS = ("moe/entropy_mean", "moe/max_fraction_max", "moe/tokens_per_layer_mean")


def _assert_same_moe_reports(name: str, dp: Path, pp: Path, steps: int = STEPS) -> None:
    """The pp run's workload reports are the whole model's (every stage's MoE layers), as the dp run's."""
    for key in MOE_METRICS:
        a, b = _column(dp, key), _column(pp, key)
        assert len(a) == len(b) == steps and max(abs(x - y) for x, y in zip(a, b)) <= 1e-9, (name, key, a, b)
    with open(dp / "moe_layer_expert_table.csv") as f_dp, open(pp / "moe_layer_expert_table.csv") as f_pp:
        table = list(csv.DictReader(f_dp))
        assert table and table == list(csv.DictReader(f_pp)), name


def _moe_on_both_stages(tmp: Path, rank: int) -> None:
    """A tiny 3-layer Qwen3-MoE text model (layers 0 and 2 MoE, layer 1 dense): at pp = 2 each stage holds one MoE
    layer, and the reports (written by rank 0, on the first stage) must still cover both: the dp run's."""
    steps, model = 3, tmp / "qwen3_moe" / "model"
    if rank == 0:
        build_tiny_qwen_text_folder(model, model_type="qwen3_moe", layers=3)
    dist.barrier()
    outs = {}
    for name, layout in (("dp", {"train.micro_batches_per_step": 1}),
                         ("pp", {"parallel.pp": 2, "train.micro_batches_per_step": 2})):
        out = outs[name] = tmp / "qwen3_moe" / name
        sets = {"model.path": f'"{model}"', "data.max_tokens_per_pack": 128, "data.num_workers": 0,
                "train.output_dir": f'"{out}"', "train.max_steps": steps, "train.eval_every": 0, "train.log_every": 1,
                "checkpoint.enable": "false", "checkpoint.resume": '"none"', "logging.tensorboard": "false",
                "logging.console": "false", "optimizer.lr": 1e-3, "data.train_path": f'"{tmp / "arith" / "train.parquet"}"',
                "data.eval_path": '""', "moe.n_step_per_workload_report": 1, **layout}
        cfg = load_config(CONFIGS / "demo_math_sft.toml", [f"{k}={v}" for k, v in sets.items()])
        if rank == 0:
            out.mkdir(parents=True)
        dist.barrier()
        assert run_kind(RunContext(cfg=cfg, env=init_distributed(), run_dir=out)) == 0
        dist.barrier()
    if rank == 0:
        for key in ("loss", "grad_norm"):
            a, b = _column(outs["dp"], key), _column(outs["pp"], key)
            assert len(a) == len(b) == steps and max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= 1e-5, (key, a, b)
        _assert_same_moe_reports("qwen3_moe", outs["dp"], outs["pp"], steps)
        with open(outs["pp"] / "moe_layer_expert_table.csv") as f:
            assert {r["layer"] for r in csv.DictReader(f)} == {"0", "1"}  # both stages' MoE layers
    dist.barrier()


def _families(tmp: Path, rank: int) -> None:
    # `mfu` on the CPU: a stand-in peak, so that the dp and pp runs log it (6 x parameters x tokens/s / peak x ranks)
    sft._peak_flops = lambda device: PEAK  # noqa: ARG005
    if rank == 0:
        write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
    init_distributed()
    dist.barrier()
    for family in FAMILIES:
        dp, pp = tmp / family / "dp", tmp / family / "pp"
        resumable = {"checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2} if family == "qwen2_5_vl" else {}
        # the MoE families report their expert loads every step: the second stage holds none of their MoE layers
        report = {"moe.n_step_per_workload_report": 1} if family in MOE_FAMILIES else {}
        if family == "nemotron_vl":  # a Mamba2 op forced: the second stage holds no Mamba2 layer either
            report["kernels.causal_conv1d"] = '"torch"'
        _run(tmp, family, dp, **{"train.micro_batches_per_step": 1, **resumable, **report})
        _run(tmp, family, pp, **{"parallel.pp": 2, "train.micro_batches_per_step": 2, **resumable, **report})
        if rank == 0:
            _assert_same_training(family, "pp", dp, pp)
            # the parameters of the whole model, not of rank 0's stage: mfu / tokens_per_s = 6 N / (peak x ranks)
            for out in (dp, pp):
                ratio = [m / t for m, t in zip(_column(out, "mfu"), _column(out, "tokens_per_s"))]
                assert max(abs(r * PEAK * 2 / 6 - _num_params(tmp, family)) for r in ratio) <= 1e-3, (family, out, ratio)
            if report:
                _assert_same_moe_reports(family, dp, pp)
        dist.barrier()
    _moe_on_both_stages(tmp, rank)
    # layout change: the pp=2 checkpoint of step 5 resumes as a dp-only run (2 data-parallel ranks)
    _resumes_as_dp(tmp, rank, "pp")
    # and the reverse: the dp-only checkpoint of step 5 resumes as a pp=2 run
    _resumes_as_dp(tmp, rank, "dp", as_layout={"parallel.pp": 2, "train.micro_batches_per_step": 2})


def test_pp2_matches_dp_for_every_family(tmp_path):
    spawn(tmp_path, _families, init_group=False)  # rank 0 writes the arithmetic data before the rendezvous
