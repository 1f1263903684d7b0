"""The SFT step on two ranks: the loss logged is the sum of -log p over both ranks' trained tokens divided by their
count, and a non-finite loss on one rank skips the optimizer step on both (neither moves, both count it).

The step reads its loss sum once, all-reduced with the gradient norm's read (training/sft.py `global_loss_and_norm`)
instead of an `any_rank` of each rank's own loss: this checks that the sum over the ranks still stops every rank.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep
from megatron_vlm.training.signals import StopFlag
from tests.integration.parallel.spawn import spawn
from tests.unit.training.test_review_sft_step import ListLoader, NoCheckpoints, Recorder, _pack
from tests.unit.training.test_step_host_reads import MaskFreeLM

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]


def _packs(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(10 + rank)
    packs = [_pack(g, 9, 7 - 3 * rank) for _ in range(3)]
    if rank == 1:
        packs[1]["poison"] = True  # step 2: NaN log-probs on this rank only
    return packs


class PoisonLM(MaskFreeLM):
    def forward(self, batch):
        out = super().forward(batch)
        return out * float("nan") if batch.get("poison") else out


def _two_ranks(tmp: Path, rank: int) -> None:
    torch.manual_seed(0)
    model = PoisonLM()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = NS(train=NS(micro_batches_per_step=1, max_grad_norm=1.0, max_consecutive_skipped_steps=5))
    cpu = torch.device("cpu")
    ctx = NS(cfg=cfg, env=NS(device=cpu, world_size=2, rank=rank, is_main=rank == 0), run_dir=tmp, stop=StopFlag(),
             device=cpu, to_device=lambda b: b)
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=2), trainable_params=list(model.parameters()),
                moe_balancer=None, pipeline=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    moved = []
    opt.register_step_post_hook(lambda o, a, k: moved.append(True))
    metrics = Recorder()
    step = SFTStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), metrics,
                   ListLoader(_packs(rank)), total_steps=3)
    ref = PoisonLM()
    ref.load_state_dict({k: v for k, v in zip(model.state_dict(), before)})
    assert run_loop(ctx, step, total_steps=3, checkpointer=NoCheckpoints(), metrics=metrics, log_every=1) == 0
    rows = [m for split, _, m in metrics.rows if split == "train"]
    assert len(moved) == 2 and [r["skipped_steps"] for r in rows] == [0.0, 1.0, 1.0], (rank, moved, rows)
    # step 1 on the weights before any update: every rank's -log p summed, over every rank's trained tokens
    with torch.no_grad():
        first = [_packs(r)[0] for r in (0, 1)]
        total = sum(float(-ref(p).sum(dtype=torch.float64)) for p in first)
        count = sum(int(p["num_label_tokens"]) for p in first)
    assert math.isclose(rows[0]["loss"], total / count, rel_tol=1e-12), (rank, rows[0]["loss"], total / count)
    assert math.isnan(rows[1]["loss"]) and math.isfinite(rows[2]["loss"]), (rank, rows)


def test_two_ranks_log_the_global_loss_and_skip_together(tmp_path):
    spawn(tmp_path, _two_ranks)
