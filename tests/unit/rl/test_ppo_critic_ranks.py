"""The critic on two data-parallel ranks (gloo): each rank holds half of a step's samples, a different number
of tokens, and the critic's update (gradients summed over the shards, the loss normalised by the mini-batch's
global count) and its whitened advantages equal the one-process critic's on all the samples. The same holds,
metrics included, when one rank has no sample in the step (its groups dropped as equal-reward ones, or its
completions cut at max_new_tokens with update.mask_truncated). A MoE auxiliary loss (a stand-in balancer) is a mean
over the packs of every shard, as in one process: a rank without packs does not halve it."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.data_shards import DataShards
from tests.fixtures.rl_config import rl_config

WORLD = 2
LENGTHS = (3, 5, 2, 4, 1, 6)


class _LinearValues(torch.nn.Module):
    """Values = a Linear map of per-token features carried by the samples (the pack's layout)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, batch):
        return self.lin(torch.cat([s._x for s in batch["group"]])).squeeze(-1)


def _samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(LENGTHS):
        s = TrainSample(prompt=None, response_ids=torch.zeros(n, dtype=torch.long), behav_logp=torch.zeros(n),  # type: ignore[arg-type]
                        advantage=0.0, old_logp=torch.zeros(n), score=float(i % 2))
        s._x = torch.randn(n, 4, generator=g)  # type: ignore[attr-defined]
        out.append(s)
    return out


class _Balancer:
    """A MoE balancer stand-in: each forward's auxiliary term is 0.3 x sum(lin.weight^2), the same function of the
    weights for every pack, so that its weights (a mean over the mini-batch's packs, every shard's) show."""

    def __init__(self, model: _LinearValues):
        self.model = model

    def aux_loss(self):
        return 0.3 * (self.model.lin.weight ** 2).sum()

    def after_step(self, step):  # noqa: ARG002
        return None


def _critic_step(samples, shards, loss_agg):
    rl = rl_config(advantage="gae", loss_agg=loss_agg, critic__value_clip=0.1, advantages__lam=0.9, ppo_epochs=2)
    model = _LinearValues()
    # SGD: the update is linear in the gradient (Adam's first step is about its sign), so a gradient that is not
    # the global one shows
    critic = Critic(model, torch.optim.SGD(model.parameters(), lr=0.5), rl, shards=shards,  # type: ignore[arg-type]
                    max_grad_norm=0.0, seed=0, balancer=_Balancer(model))
    packs, to_batch = (lambda ss: [list(ss)] if ss else []), (lambda grp: {"group": grp})
    critic.prepare(samples, packs, to_batch)
    adv = [s.token_advantages.clone() for s in samples]
    metrics = critic.update(0, samples, packs, to_batch)
    return [p.detach().clone() for p in model.parameters()], adv, metrics


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        shards = DataShards(rank=rank, world=WORLD, copies=1, device=torch.device("cpu"))
        mine = _samples()[rank::WORLD]
        res = {agg: _critic_step(mine, shards, agg) for agg in ("token-mean", "seq-mean")}
        res["empty rank 1"] = _critic_step(_samples() if rank == 0 else [], shards, "token-mean")
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two ranks returned (one spawn for the module's tests)."""
    tmp = tmp_path_factory.mktemp("critic_ranks")
    out = str(tmp / "res")
    mp.spawn(_worker, args=(str(tmp / "store"), out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


def test_two_ranks_equal_one_process(ranks):
    one = DataShards(rank=0, world=1, copies=1, device=torch.device("cpu"))
    for agg in ("token-mean", "seq-mean"):
        params, adv, metrics = _critic_step(_samples(), one, agg)
        for r in range(WORLD):
            for a, b in zip(params, ranks[r][agg][0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(adv[r::WORLD], ranks[r][agg][1]):  # the global whitening
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert abs(metrics["critic/value_loss"] - ranks[0][agg][2]["critic/value_loss"]) < 1e-6
        assert params[0].ne(_LinearValues().lin.weight.detach()).any()  # the update moved the critic




def test_a_rank_without_samples_equals_one_process(ranks):
    params, _, metrics = _critic_step(_samples(), DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")),
                                      "token-mean")
    for r in range(WORLD):
        got = ranks[r]["empty rank 1"]
        for a, b in zip(params, got[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert got[2].keys() == metrics.keys()
        for key, value in metrics.items():
            assert abs(got[2][key] - value) < 1e-5 * max(1.0, abs(value)), (r, key)
