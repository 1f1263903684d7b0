"""The GRPO policy update on two data-parallel ranks (gloo, DistributedDataParallel averaging the gradients as FSDP
does) against one process holding every sample: rank 0 holds six samples in several packs, rank 1 two samples in
fewer packs (a different count of response tokens and of packs), so the ranks also run filler forwards.

The reference is plain arithmetic on the one-process update: the loss of the mini-batch is normalised by its global
token count (`token-mean`), sequence count (`seq-mean`) or max_new_tokens x sequences (Dr. GRPO's), and the MoE
auxiliary loss is a mean over the mini-batch's packs, all ranks' (weights summing to 1, whatever the layout; here a
stand-in balancer whose per-pack term is the same function of the weights, so its gradient reaches the update with
weight exactly 1 in one process). SGD, so that a gradient that is not the global one shows in the parameters.
"""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.training.optim import OptimState
from tests.unit.rl.test_review_grpo_update import TinyPolicy, _logp, _samples

WORLD = 2
AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
AUX_COEF = 0.7


class _Balancer:
    """A MoE balancer stand-in: each forward's auxiliary term is AUX_COEF x sum(head.weight^2)."""

    def __init__(self, policy: TinyPolicy):
        self.policy = policy
        self.calls = 0

    def aux_loss(self) -> torch.Tensor:
        self.calls += 1
        return AUX_COEF * (self.policy.head.weight ** 2).sum()

    def after_step(self, step: int):  # noqa: ARG002
        return None


def _all_samples() -> list:
    g = torch.Generator().manual_seed(7)
    samples = _samples(g, 8)
    torch.manual_seed(0)
    policy = TinyPolicy()  # the weights every update starts from (`_update` seeds alike)
    with torch.no_grad():
        for s in samples:
            s.old_logp = _logp(policy, s)  # on-policy: ratio 1
    return samples


def _update(samples: list, *, rank: int, world: int, loss_agg: str, ddp: bool):
    torch.manual_seed(0)
    module = TinyPolicy()
    policy = DistributedDataParallel(module) if ddp else module
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=rank, world_size=world),
             cfg=NS(data=NS(max_tokens_per_pack=12), train=NS(seed=5, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=world, dp_rank=rank), wrapper=policy, model=module,
                trainable_params=list(policy.parameters()), moe_balancer=_Balancer(module))
    rl = NS(accuracy_label=lambda: "acc", policy_loss="clip", advantage="grpo", allocation=None, recompute_logprobs=False,
            batch=NS(ppo_epochs=1, mini_batches_per_step=1, group_size=2),
            rollout=NS(temperature=1.0, max_new_tokens=8),
            loss=NS(loss_agg=loss_agg, clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.0, kl_estimator="k3",
                    entropy_coef=0.0, rollout_correction="none", rollout_correction_cap=2.0),
            advantages=NS(overlong_buffer=0, dynamic_sampling=False, normalize_std=None, drop_equal_reward_groups=False,
                          kl_in_reward=None),
            update=NS(mask_truncated=False, prompt_sharing="off", skip_zero_advantage=False),
            asynchronous=NS(max_head_offpolicyness=0), eval=NS(correct_threshold=1.0))
    grpo = GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl,
                    engine=None, encoder=NS(skipped=0), manager=NS(labels=["acc"], metrics=lambda: {}))
    packs = len(grpo.policy.packs(samples))
    grpo.policy.update(0, samples, samples[0])
    return [p.detach().clone() for p in module.parameters()], packs


def _shard(samples: list, rank: int) -> list:
    return samples[:6] if rank == 0 else samples[6:]


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        mine = _shard(_all_samples(), rank)
        torch.save({agg: _update(mine, rank=rank, world=WORLD, loss_agg=agg, ddp=True) for agg in AGGS}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_uneven_packs_equal_one_process(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=WORLD, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert ranks[0][AGGS[0]][1] > ranks[1][AGGS[0]][1] >= 1  # the ranks' pack counts differ: rank 1 runs fillers
    torch.manual_seed(0)
    start = [p.detach() for p in TinyPolicy().parameters()]
    for agg in AGGS:
        ref, _ = _update(_all_samples(), rank=0, world=1, loss_agg=agg, ddp=False)
        assert any(not torch.equal(a, b) for a, b in zip(ref, start))  # the update moved the policy
        for r in range(WORLD):
            for a, b in zip(ref, ranks[r][agg][0]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{agg}, rank {r}")
