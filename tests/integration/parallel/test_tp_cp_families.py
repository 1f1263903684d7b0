"""Tensor and context parallelism for every family's tiny model, on 2 gloo processes started once: for
each family a dp-only SFT run (2 data-parallel ranks, 1 micro-batch each), a `parallel.tp=2` run and a
`parallel.cp=2` run (one data-parallel rank reading the same 2 micro-batches per step: the same packs
per step) give the same 10 losses and grad norms (fp32, 1e-5) and the same Hugging Face export (1e-6).
The MoE families train with the [moe] auxiliary loss on: under cp it must stay the whole pack's loss (each
rank routes only its chunks; a per-chunk loss moved the cp run's losses by ~1e-4), and the MoE model's dp run,
resumed from its step-5 checkpoint, writes the uninterrupted run's step-10 workload report (the loads of steps 1-10).
The tp run's lm_head / embedding and attention projections really are split (each rank holds half the
rows; Nemotron's Mamba2 mixers run half of the heads each, tests/unit/models/test_mamba2_tp_heads.py), and the cp run's decoder layers hold half of every pack's tokens (load-balanced causal chunks;
Nemotron's Mamba2 layers left unsplit), so neither comparison is between two replicated runs.

In the same workers: the tp=2 run's step-5 checkpoint resumes as a dp-only run (layout change) with the
tp run's last 5 losses and export; and two GRPO steps with tp=2 (the rollout engine runs sharded, every
tp rank of a group generating the same answers) and with cp=2 (the rollout runs unsharded on both cp
ranks, which generate the same answers; the packed policy forwards split the tokens) match one process
(loss, grad norm, reward). A second,
slow test on 4 processes against dp=4: ep=2 x tp=2 (MoE), which is also tp=2 x dp=2, and tp=2 x cp=2.

The jobs run in-process in the workers (`megatron_vlm.jobs.run_kind` on one process group) to pay the
process start-up and imports once. The suite runs three families (`CI_FAMILIES`: dense, MoE, the Mamba2 hybrid)
with the resume and GRPO checks; the other three run in a heavy test (CI's time budget).
"""
from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron_vlm.config import load_config
from megatron_vlm.data.synthetic_arith import write_synthetic_arith
from megatron_vlm.jobs import run_kind
from megatron_vlm.parallel import DistEnv, init_distributed
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.context import RunContext
from tests.integration.jobs import as_overrides
from tests.integration.parallel.spawn import spawn

pytestmark = [pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"
STEPS = 10

# family -> (config, tiny model)
FAMILIES = {
    "qwen2_5_vl": ("demo_sft.toml", "tiny_qwen2_5_vl"),
    "qwen3_vl": ("demo_qwen3_vl.toml", "tiny_qwen3_vl"),
    "qwen3_vl_moe": ("demo_qwen3_vl.toml", "tiny_qwen3_vl_moe"),
    "internvl": ("demo_internvl.toml", "tiny_internvl"),
    "nemotron_vl": ("demo_nemotron_vl.toml", "tiny_nemotron_vl"),
    "qwen_text": ("demo_math_sft.toml", "tiny_qwen3"),
}


def _sets(tmp: Path, family: str, out: Path, **extra) -> list[str]:
    config, synth = FAMILIES[family]
    sets = {
        "model.path": f'"{tmp / family / "model"}"', "model.synthesize": f'"{synth}"',
        "data.max_tokens_per_pack": 128, "data.num_workers": 0, "train.output_dir": f'"{out}"',
        "train.max_steps": STEPS, "train.eval_every": 0, "train.log_every": 1,
        "checkpoint.enable": "false", "checkpoint.keep_last": 0, "checkpoint.resume": '"none"', "logging.tensorboard": "false", "logging.console": "false",
        "scheduler.warmup_steps": 1, "optimizer.lr": 1e-5,
    }
    if family == "qwen_text":
        paths = tmp / "arith"
        sets.update({"data.train_path": f'"{paths / "train.parquet"}"', "data.eval_path": '""'})
    else:
        sets.update({"data.synthetic_dir": f'"{tmp / family / "data"}"', "data.synthetic_train_size": 48,
                     "data.synthetic_eval_size": 0})
    return as_overrides(sets, extra)  # checkpoint.keep_last only where a job saves (checkpoint.enable = "true")


def _run(tmp: Path, family: str, out: Path, **extra) -> None:
    cfg = load_config(CONFIGS / FAMILIES[family][0], _sets(tmp, family, out, **extra))
    env = init_distributed()
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not (Path(cfg.model.path) / "config.json").is_file():
            synthesize_model_folder(cfg.model.synthesize, cfg.model.path, seed=cfg.train.seed)
    dist.barrier()
    assert run_kind(RunContext(cfg=cfg, env=env, run_dir=out)) == 0
    dist.barrier()


def _grpo(model: Path, out: Path, env: DistEnv, **extra) -> None:
    """Two GRPO steps of the demo config on the tiny Qwen2.5-VL with a graded (length) reward."""
    sets = {
        "model.path": f'"{model}"', "data.synthetic_dir": f'"{model.parent / "data"}"', "data.synthetic_train_size": 48,
        "data.synthetic_eval_size": 0, "data.max_tokens_per_pack": 160, "train.output_dir": f'"{out}"',
        "train.max_steps": 2, "logging.tensorboard": "false", "logging.console": "false", "checkpoint.enable": "false",
        "checkpoint.export_hf": "false", "optimizer.lr": 1e-3, "rl.batch.group_size": 4, "rl.batch.prompts_per_step": 4,
        "rl.rollout.max_new_tokens": 6, "rl.model_path_hint": '""', "rl.eval.every_steps": 0, "rl.eval.at_start": "false",
        "rl.rewards": '[{type = "custom", function = "tests.integration.grpo_reward_fns.text_length", kwargs = {cap = 40}}]',
    }
    sets.update(extra)
    cfg = load_config(CONFIGS / "demo_grpo.toml", [f"{k}={v}" for k, v in sets.items()])
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    assert run_kind(RunContext(cfg=cfg, env=env, run_dir=out)) == 0


def _column(out: Path, key: str) -> list[float]:
    with open(out / "metrics_train.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f)]


def _export(out: Path) -> dict:
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _assert_same_training(family: str, layout: str, dp: Path, other: Path) -> None:
    l_dp, l_o = _column(dp, "loss"), _column(other, "loss")
    assert len(l_dp) == len(l_o) == STEPS, (family, layout, l_dp, l_o)
    assert len(set(l_dp)) > 1, (family, l_dp)  # the model trains: the comparison is not of constants
    worst = max(abs(a - b) for a, b in zip(l_dp, l_o))
    assert worst <= 1e-5, (family, layout, worst, l_dp, l_o)
    # the gradients too (a wrongly scaled gradient would hide behind Adam's normalisation)
    g_dp, g_o = _column(dp, "grad_norm"), _column(other, "grad_norm")
    assert max(abs(a - b) / a for a, b in zip(g_dp, g_o)) <= 1e-5, (family, layout, g_dp, g_o)
    e_dp, e_o = _export(dp), _export(other)
    assert e_dp.keys() == e_o.keys() and e_dp, (family, layout)
    diff = max(((e_dp[k] - e_o[k]).abs().max().item(), k) for k in e_dp)
    assert diff[0] <= 1e-6, (family, layout, diff)


def _resumes_as_dp(tmp: Path, rank: int, layout: str, as_layout: Optional[dict] = None) -> None:
    """Layout change: the Qwen2.5-VL `layout` run's checkpoint of step STEPS // 2 resumes as a dp-only run (2
    data-parallel ranks; or with the settings `as_layout`) with that run's last losses (1e-5) and its export (1e-6)."""
    run, resumed = tmp / "qwen2_5_vl" / layout, tmp / "qwen2_5_vl" / f"resumed_{layout}"
    if rank == 0:
        shutil.copytree(run / "checkpoints" / f"step_{STEPS // 2}", resumed / "checkpoints" / f"step_{STEPS // 2}")
    dist.barrier()
    _run(tmp, "qwen2_5_vl", resumed, **{"train.micro_batches_per_step": 1, "checkpoint.enable": "true",
                                        "checkpoint.resume": '"auto"', **(as_layout or {})})
    if rank == 0:
        l_run, l_res = _column(run, "loss"), _column(resumed, "loss")
        assert len(l_res) == STEPS - STEPS // 2, l_res
        assert max(abs(a - b) for a, b in zip(l_run[STEPS // 2:], l_res)) <= 1e-5, (layout, l_run, l_res)
        e_run, e_res = _export(run), _export(resumed)
        assert e_run.keys() == e_res.keys() and e_run, layout
        assert max((e_run[k] - e_res[k]).abs().max().item() for k in e_run) <= 1e-6, layout


MOE_AUX = {"moe.aux_loss_coef": 5.0}
"""The MoE families train with the Switch auxiliary loss (a large weight, so that its gradient shows in the grad
norm): with cp each rank routes its chunks of a pack, and the loss must still be the whole pack's, as with dp."""

MOE_REPORT = {"moe.n_step_per_workload_report": STEPS, "checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2}


def _moe_report_resumes(tmp: Path, rank: int, family: str, run: Path, **sets) -> None:
    """`run`'s step-5 checkpoint resumed: the same last losses and the same step-10 workload report, the loads of
    steps 1-10 (the checkpoint carries those of steps 1-5), not of steps 6-10 alone."""
    resumed = tmp / family / "resumed_dp"
    if rank == 0:
        shutil.copytree(run / "checkpoints" / f"step_{STEPS // 2}", resumed / "checkpoints" / f"step_{STEPS // 2}")
    dist.barrier()
    _run(tmp, family, resumed, **{**sets, "checkpoint.resume": '"auto"'})
    if rank == 0:
        assert _column(run, "loss")[STEPS // 2:] == _column(resumed, "loss"), family
        with open(run / "moe_layer_expert_table.csv") as f_run, open(resumed / "moe_layer_expert_table.csv") as f_res:
            table = list(csv.DictReader(f_run))
            assert table and table == list(csv.DictReader(f_res)), family
    dist.barrier()


CI_FAMILIES = ("qwen2_5_vl", "qwen3_vl_moe", "nemotron_vl")
"""The families of the suite's run (the dense VLM that also resumes across layouts, MoE, the Mamba2 hybrid); the
other three run in the heavy test (`-m heavy`): each family is three 2-rank jobs, ~45 s of the CI budget."""


def _families(tmp: Path, rank: int, families=CI_FAMILIES, grpo: bool = True) -> None:
    grpo_model = tmp / "grpo" / "model"
    if rank == 0:  # the arithmetic set (GRPO's prompts, the text family's SFT data); rank 1 waits in the rendezvous
        write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
    if rank == 0 and grpo:
        # the one-process GRPO reference, in a one-rank group before the 2-rank group exists
        # (rank 1 waits for rank 0 in the rendezvous below)
        synthesize_model_folder("tiny_qwen2_5_vl", grpo_model, seed=0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _grpo(grpo_model, tmp / "grpo" / "dp1", DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
        dist.destroy_process_group()
    init_distributed()
    for family in families:
        dp, tp = tmp / family / "dp", tmp / family / "tp"
        aux = MOE_AUX if family in ("qwen3_vl_moe", "nemotron_vl") else {}
        # the MoE model's dp run reports its expert loads at step 10 (those of steps 1-10) and resumes from step 5
        report = MOE_REPORT if family == "qwen3_vl_moe" else {}
        _run(tmp, family, dp, **{"train.micro_batches_per_step": 1, **aux, **report})
        if report:
            _moe_report_resumes(tmp, rank, family, dp, **{"train.micro_batches_per_step": 1, **aux, **report})
        resumable = {"checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2} if family == "qwen2_5_vl" else {}
        # activation checkpointing recomputes the sequence-parallel layers (hooks, collectives) in backward: whole
        # blocks, or selectively (kept matmul / attention outputs are DTensor-local ops' outputs; Mamba2's scan too)
        recompute = {"qwen3_vl": {"train.activation_checkpointing": "true"},
                     "nemotron_vl": {"train.activation_checkpointing": '"selective"'}}.get(family, {})
        _run(tmp, family, tp, **{"parallel.tp": 2, "train.micro_batches_per_step": 2, **resumable, **recompute, **aux})
        if rank == 0:
            _assert_same_training(family, "tp", dp, tp)
        dist.barrier()
        cp = tmp / family / "cp"
        _run(tmp, family, cp, **{"parallel.cp": 2, "train.micro_batches_per_step": 2, **aux})
        if rank == 0:
            _assert_same_training(family, "cp", dp, cp)
        dist.barrier()
    if not grpo:
        return
    # layout change: the tp=2 checkpoint of step 5 resumes as a dp-only run (2 data-parallel ranks)
    _resumes_as_dp(tmp, rank, "tp")
    # GRPO with tp=2 (the rollout engine runs sharded) and with cp=2: the same first steps as one process
    for layout in ("tp", "cp"):
        _grpo(grpo_model, tmp / "grpo" / f"{layout}2", init_distributed(), **{f"parallel.{layout}": 2})
        if rank == 0:
            for key in ("loss", "grad_norm", "reward/mean"):
                ref, got = _column(tmp / "grpo" / "dp1", key), _column(tmp / "grpo" / f"{layout}2", key)
                scale = max(1.0, max(abs(v) for v in ref))  # grad norms: relative
                assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                    (layout, key, ref, got)
            assert _column(tmp / "grpo" / "dp1", "grad_norm")[0] > 0  # a real update
        dist.barrier()


def _other_families(tmp: Path, rank: int) -> None:
    _families(tmp, rank, tuple(f for f in FAMILIES if f not in CI_FAMILIES), grpo=False)


def test_tp2_and_cp2_match_dp_dense_moe_hybrid_resume_and_grpo(tmp_path):
    spawn(tmp_path, _families, init_group=False)  # rank 0 runs the one-process GRPO reference first


@pytest.mark.heavy
def test_tp2_and_cp2_match_dp_for_the_other_families(tmp_path):
    spawn(tmp_path, _other_families, init_group=False)


def _four_ranks(tmp: Path, rank: int) -> None:
    """Against dp=4, 4 steps each: ep=2 x tp=2 x dp=2 on Nemotron-VL (MoE experts split over the 2 ep ranks
    of one tp coordinate, attention / MLP / Mamba2 over tp, 2 data-parallel ranks), and tp=2 x cp=2 (one
    data-parallel rank reading the 4 micro-batches) on Nemotron-VL and Qwen2.5-VL (M-RoPE): the cp ranks
    keep their chunks of each pack, the tp ranks split those chunks' tokens and the heads."""
    runs = (("nemotron_vl", "tp_ep", {"parallel.tp": 2, "parallel.ep": 2, "train.micro_batches_per_step": 2}),
            ("nemotron_vl", "tp_cp", {"parallel.tp": 2, "parallel.cp": 2, "train.micro_batches_per_step": 4}),
            ("qwen2_5_vl", "tp_cp", {"parallel.tp": 2, "parallel.cp": 2, "train.micro_batches_per_step": 4}))
    for family, name, layout in runs:
        dp, tp = tmp / family / "dp", tmp / family / name
        if not (dp / "metrics_train.csv").is_file():
            _run(tmp, family, dp, **{"train.micro_batches_per_step": 1, "train.max_steps": 4})
        _run(tmp, family, tp, **{**layout, "train.max_steps": 4})
        if rank == 0:
            for key in ("loss", "grad_norm"):
                a, b = _column(dp, key), _column(tp, key)
                assert len(a) == len(b) == 4 and max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)) <= 1e-5, \
                    (family, name, key, a, b)
            e_dp, e_tp = _export(dp), _export(tp)
            assert e_dp.keys() == e_tp.keys() and e_dp, family
            diff = max(((e_dp[k] - e_tp[k]).abs().max().item(), k) for k in e_dp)
            assert diff[0] <= 1e-6, (family, name, diff)
        dist.barrier()


@pytest.mark.slow
@pytest.mark.heavy
def test_tp2_with_dp2_ep2_and_cp2_on_4_processes(tmp_path):
    spawn(tmp_path, _four_ranks, world=4)
