"""`rl.update.skip_zero_advantage` on two data-parallel ranks (gloo, DistributedDataParallel): rank 0's prompts are all
constant (every completion has advantage 0, nothing to forward), rank 1's informative. The ranks must still make
the same collective calls (DDP all-reduces in every backward, the step sums counts across ranks): rank 0 runs one
zero-gradient forward where rank 1 trains, in the update and in the old-log-prob forward of recompute_logprobs,
and the parameters equal those of the run that forwards every completion."""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.training.optim import OptimState
from tests.unit.rl.test_grpo_step_algorithms import Encoder, Engine, Manager, TinyPolicy, _pool, _rl

WORLD = 2


def _run(rank: int, skip: bool, **rl_kw):
    rl = _rl(skip_zero_advantage=skip, **rl_kw)
    torch.manual_seed(0)
    policy = DistributedDataParallel(TinyPolicy())
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05, weight_decay=0.1)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=rank, world_size=WORLD),
             cfg=NS(data=NS(max_tokens_per_pack=64), train=NS(seed=3, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=WORLD, dp_rank=rank), wrapper=policy, trainable_params=list(policy.parameters()),
                moe_balancer=None)
    pool = _pool(8)  # p0, p2, ... constant; round-robin shards: rank 0 gets p0, p2, rank 1 gets p1, p3
    grpo = GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl,
                    Engine(rl.batch.group_size, rl.rollout.max_new_tokens), Encoder(), Manager(pool))
    metrics = [grpo.run(i, pool[4 * i:4 * i + 4], prompt_pool=pool) for i in range(2)]
    return [p.detach().clone() for p in policy.parameters()], metrics


def _worker(rank: int, init_file: str, out: str) -> None:
    # a rank that skips a collective the other makes fails after the timeout instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, kw in (("plain", {}), ("recompute", {"recompute_logprobs": True})):
            p_on, m_on = _run(rank, True, **kw)
            p_off, m_off = _run(rank, False, **kw)
            results[name] = (p_on, p_off, [m["train/zero_adv_skipped"] for m in m_on], [m["loss"] for m in m_on],
                             [m["loss"] for m in m_off])
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_with_nothing_to_forward_stay_in_step(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=WORLD, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for name in ("plain", "recompute"):
        for rank in range(WORLD):
            p_on, p_off, skipped, loss_on, loss_off = ranks[rank][name]
            for a, b in zip(p_on, p_off):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert skipped == [6.0, 6.0]  # rank 0's 2 constant groups of G = 3, summed over ranks
            assert loss_on == pytest.approx(loss_off, rel=1e-5, abs=1e-7)
        for a, b in zip(ranks[0][name][0], ranks[1][name][0]):  # DDP: the ranks agree
            assert torch.equal(a, b)
