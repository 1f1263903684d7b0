"""Pipeline parallelism with a stage between the two holders of a tied embedding / lm_head: pp=3 x dp=2 on 6 gloo
processes, a tied 3-layer Qwen2 text model, against dp=6 reading the same 6 micro-batches per step.

The middle stage holds neither copy of the tied weight but joins the all-reduce that sums the two holders'
gradients; its zeros must have the shape of the holders' FSDP2 shard (rows chunked over dp_shard), not the whole
weight's (a gloo size mismatch aborted the processes). Heavy: six processes on the 2-core CI machine.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_vlm.config import load_config
from megatron_vlm.data.synthetic_arith import write_synthetic_arith
from megatron_vlm.jobs import run_kind
from megatron_vlm.parallel import init_distributed
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
from megatron_vlm.training.context import RunContext
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_tp_cp_families import CONFIGS, _column, _export

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]


def _run(tmp: Path, out: Path, **extra) -> None:
    sets = {"model.path": f'"{tmp / "model"}"', "data.max_tokens_per_pack": 128, "data.num_workers": 0,
            "train.output_dir": f'"{out}"', "train.max_steps": 3, "train.eval_every": 0, "train.log_every": 1,
            "checkpoint.enable": "false", "checkpoint.resume": '"none"', "logging.tensorboard": "false",
            "logging.console": "false", "scheduler.warmup_steps": 1, "optimizer.lr": 1e-5,
            "data.train_path": f'"{tmp / "arith" / "train.parquet"}"', "data.eval_path": '""', **extra}
    cfg = load_config(CONFIGS / "demo_math_sft.toml", [f"{k}={v}" for k, v in sets.items()])
    env = init_distributed()
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    assert run_kind(RunContext(cfg=cfg, env=env, run_dir=out)) == 0
    dist.barrier()


def _part(tmp: Path, rank: int) -> None:
    if rank == 0:
        write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
        build_tiny_qwen_text_folder(tmp / "model", model_type="qwen2", layers=3)  # tied embedding / lm_head
    init_distributed()
    dist.barrier()
    _run(tmp, tmp / "dp", **{"train.micro_batches_per_step": 1})
    _run(tmp, tmp / "pp", **{"parallel.pp": 3, "train.micro_batches_per_step": 3})
    if rank == 0:
        l_dp, l_pp = _column(tmp / "dp", "loss"), _column(tmp / "pp", "loss")
        assert len(l_dp) == len(l_pp) == 3 and len(set(l_dp)) > 1, (l_dp, l_pp)
        assert max(abs(a - b) for a, b in zip(l_dp, l_pp)) <= 1e-5, (l_dp, l_pp)
        g_dp, g_pp = _column(tmp / "dp", "grad_norm"), _column(tmp / "pp", "grad_norm")
        assert max(abs(a - b) / a for a, b in zip(g_dp, g_pp)) <= 1e-5, (g_dp, g_pp)
        e_dp, e_pp = _export(tmp / "dp"), _export(tmp / "pp")
        assert e_dp.keys() == e_pp.keys() and e_dp
        assert max((e_dp[k] - e_pp[k]).abs().max().item() for k in e_dp) <= 1e-6


def test_pp3_with_dp2_and_a_tied_embedding_matches_dp(tmp_path):
    spawn(tmp_path, _part, world=6, init_group=False)  # rank 0 writes the data and model before the rendezvous
