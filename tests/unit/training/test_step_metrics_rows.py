"""What the SFT and pair step runners give the loggers, run by the real loop into the real CSV sink, on a tiny
stand-in model: every row of metrics_train.csv is a whole row, and the data counters are the run's (every
data-parallel rank's), as the neighbouring step metrics are."""
from __future__ import annotations

import csv
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.training.loggers import MetricsLogger
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.pair_step import PairStep
from megatron_vlm.training.sft import SFTStep
from tests.unit.training.test_review_sft_step import ListLoader, NeverStop, NoCheckpoints, TinyLM, _pack


class ReportEveryStep:
    """A MoE balancer stand-in whose workload report comes every `every` steps (moe.n_step_per_workload_report)."""

    def __init__(self, every: int):
        self.every = every

    def aux_loss(self):
        return None

    def after_step(self, step: int):
        if step % self.every:
            return None
        return {"moe/entropy_mean": 1.0, "moe/max_fraction_max": 0.5}, [[3, 1]]


class TinyPairs(PairStep):
    """Pairs of one pack: each "pair" is the pack's trained-token log-probs (enough for the metric plumbing)."""

    sums = ("loss", "accuracy")

    def pack_forward(self, batch, split):
        return self.bundle.wrapper(batch), None

    def pack_terms(self, out, batch, extra):
        losses = -out.sum().reshape(1)
        return losses, {"loss": float(losses.sum()), "accuracy": 1.0}


def _ctx(tmp_path, micro=1):
    cfg = NS(train=NS(micro_batches_per_step=micro, max_grad_norm=0.0))
    return NS(cfg=cfg, env=NS(device=torch.device("cpu"), world_size=1, rank=0, is_main=True), run_dir=tmp_path,
              stop=NeverStop(), device=torch.device("cpu"), to_device=lambda b: b)


def _bundle(model, balancer=None):
    return NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()),
              moe_balancer=balancer, pipeline=None)


def _optim(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


@pytest.mark.parametrize("kind", ["sft", "pair"])
def test_a_moe_report_between_logged_steps_does_not_decide_the_csv_header(tmp_path, kind):
    """Before: with train.log_every = 4 and a workload report every 2 steps, step 2 logged a row of the moe/* metrics
    alone; it was the CSV's first row, so its keys became the header and loss, lr, grad_norm, ... of every later row
    went to the `extra` JSON column. Now a step with a report logs its whole row."""
    g = torch.Generator().manual_seed(0)
    packs = [_pack(g, 6, 3) for _ in range(4)]
    for p in packs:
        p["num_pairs"] = torch.tensor(1)
    model, ctx = TinyLM(), _ctx(tmp_path)
    logger = MetricsLogger(NS(tensorboard=False, csv=True, wandb=False, console=False), tmp_path, is_main=True,
                           total_steps=4, run_name="r")
    bundle, optim = _bundle(model, ReportEveryStep(2)), _optim(model)
    if kind == "sft":
        step = SFTStep(ctx, bundle, optim, logger, ListLoader(packs), total_steps=4)
    else:
        step = TinyPairs(ctx, bundle, optim, logger, ListLoader(packs))
    assert run_loop(ctx, step, total_steps=4, checkpointer=NoCheckpoints(), metrics=logger, log_every=4) == 0
    logger.close()
    with (tmp_path / "metrics_train.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["2", "4"]
    for r in rows:
        assert not r["extra"], r["extra"]
        assert float(r["loss"]) > 0 and float(r["lr"]) == pytest.approx(0.1) and float(r["moe/entropy_mean"]) == 1.0


def test_a_grpo_step_with_a_moe_report_logs_it_between_logged_steps():
    """Before: GRPO returned nothing on a step outside train.log_every, so the moe/* metrics of a workload report
    due then were never logged (SFT and the pair trainers log them); now that step logs its whole row."""
    from megatron_vlm.rl.trainer import GRPOLoopStep

    class FakeGRPO:
        engine = None

        def run(self, step, prompts, prompt_pool):
            out = {"loss": 1.0, "reward/mean": 0.5}
            if (step + 1) % 2 == 0:
                out["moe/entropy_mean"] = 1.0
            return out

    ctx = NS(cfg=NS(train=NS(seed=0), rl=NS(batch=NS(prompts_per_step=2))), env=NS(is_main=True))
    runner = GRPOLoopStep(ctx, list(range(8)), FakeGRPO())
    rows = {s + 1: runner.train_step(s, log=(s + 1) % 4 == 0) for s in range(4)}
    assert [s for s, m in rows.items() if m] == [2, 4]
    assert rows[2]["moe/entropy_mean"] == 1.0 and rows[2]["loss"] == 1.0


class CountingLoader(ListLoader):
    """Packs of this rank with `stats()` as the packed loader counts them (per rank, since the process started)."""

    def __init__(self, packs):
        super().__init__(packs)
        self.samples = self.consumed = 0

    def __iter__(self):
        for p in self.packs:
            self.samples += int(p["num_samples"])
            self.consumed += 1
            yield p

    def stats(self):
        return {"samples_seen": self.samples, "packs_consumed": self.consumed}


def _sft_two_ranks(tmp, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    packs = [_pack(g, 6, 3) for _ in range(4)]
    for p in packs:
        p["num_samples"] = torch.tensor(1 + 2 * rank)  # rank 0: 1 sample per pack, rank 1: 3
    model, ctx = TinyLM(), _ctx(tmp / f"r{rank}", micro=2)
    ctx.env = NS(device=torch.device("cpu"), world_size=2, rank=rank, is_main=rank == 0)
    bundle = _bundle(model)
    bundle.dims = NS(dp_size=2, dp_rank=rank)
    step = SFTStep(ctx, bundle, _optim(model), None, CountingLoader(packs), total_steps=2)
    rows = [step.train_step(s, log=True) for s in range(2)]
    # 2 steps x 2 packs per rank: 4 packs of 1 sample on rank 0, 4 of 3 on rank 1
    assert [r["data/samples_seen"] for r in rows] == [8.0, 16.0], rows
    assert [r["data/packs_consumed"] for r in rows] == [4.0, 8.0], rows
    assert rows[-1]["samples_per_s"] * rows[-1]["step_time_s"] == pytest.approx(8.0)
    assert step.data_state(2)["counters"]["data/samples_seen"] == 16.0


def test_sft_data_counters_sum_the_ranks_of_the_all_reduce(tmp_path, monkeypatch):
    """The fast form of the two-rank test below: a second rank that reads packs like this one's (the all-reduce
    doubles every sum). Before: data/samples_seen said 2 and 4 (this rank's loader), samples_per_s the run's 4 / step."""
    import megatron_vlm.training.sft as sft_mod

    monkeypatch.setattr(sft_mod, "all_reduce_sum", lambda values, device: [2 * float(v) for v in values])
    g = torch.Generator().manual_seed(0)
    model, ctx = TinyLM(), _ctx(tmp_path, micro=2)
    bundle = _bundle(model)
    bundle.dims = NS(dp_size=2, dp_rank=0)
    step = SFTStep(ctx, bundle, _optim(model), None, CountingLoader([_pack(g, 6, 3) for _ in range(4)]), total_steps=2)
    rows = [step.train_step(s, log=True) for s in range(2)]
    assert [(r["data/samples_seen"], r["data/packs_consumed"]) for r in rows] == [(4.0, 4.0), (8.0, 8.0)]
    assert step.data_state(2)["counters"]["data/samples_seen"] == 8.0


@pytest.mark.heavy  # ~20 s on the 2-core machine (two spawned ranks import torch)
@pytest.mark.distributed
def test_sft_data_counters_count_every_data_parallel_rank(tmp_path):
    """Before: data/samples_seen and data/packs_consumed were rank 0's loader counts (half the run's with two ranks,
    4 and 8 here instead of 8 and 16) next to trained_tokens and samples_per_s, which sum every rank; the checkpoint's
    running total of data/samples_seen was rank 0's too."""
    from tests.integration.parallel.spawn import spawn

    spawn(tmp_path, _sft_two_ranks)
