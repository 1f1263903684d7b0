"""The stop agreement of the packed-data steps (SFT, DPO, reward model) on two ranks: it rides in the all-reduce of
the step's counts (training/sft.py `agree_counts`), so a steady step reads the device twice, not three times.

On CUDA each read of a device value is a stream sync. A multi-rank step reads its token / sample counts (needed
before its forward) and its loss sum with the gradient norm (before the optimizer step); the loop used to read the
stop flag's all-reduce after every step as well (`StopFlag.should_stop`). Counted on the CPU with `HostReads`, as
tests/integration/parallel/test_pp_host_reads.py does; there a `non_blocking` move of the collectives' values to
the CPU is the tensor itself, whose read back would not be counted, so the test's `to_device` copies them (as the
move to a GPU does): each all-reduce read back counts once. The stop semantics stay: a stop asked on one rank during
step N stops both ranks at the boundary after step N (step N's checkpoint, with the data position after step N,
exit 143), step N + 1 applies nothing; one asked during the last step is still acted on.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from megatron_vlm.parallel import collectives
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training import signals
from megatron_vlm.training.loop import EXIT_STOPPED, run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep
from megatron_vlm.training.signals import StopFlag
from tests.integration.parallel.spawn import spawn
from tests.unit.training.test_pair_step_host_reads import PairLM, _dpo, _packs
from tests.unit.training.test_review_sft_step import NoCheckpoints, Recorder, _pack
from tests.unit.training.test_step_host_reads import MaskFreeLM, _device_copy

pytestmark = [pytest.mark.distributed]

STEPS = 4


class Positions:
    """A loader stand-in with a position, saved in the data state, and `mark` / `rewind` as `SFTDataLoader`'s."""

    def __init__(self, packs: list[dict]):
        self.packs, self.epoch, self.consumed, self._mark = packs, 0, 0, None

    def __iter__(self):
        while True:
            self.consumed += 1
            yield self.packs[self.consumed - 1]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def mark(self) -> None:
        self._mark = self.consumed

    def rewind(self) -> None:
        self.consumed = self._mark


class Saves(NoCheckpoints):
    enabled = True

    def __init__(self):
        self.saved: list[tuple[int, int]] = []

    def save(self, step: int, data_state: dict) -> None:
        self.saved.append((step, data_state["consumed"]))


class StopDuring(nn.Module):
    """`inner`, asking this rank to stop (as SIGTERM's handler does) during its forward number `at` (1-based; one
    micro-batch per step: during step `at`)."""

    def __init__(self, inner: nn.Module, flag: StopFlag, at: int):
        super().__init__()
        self.inner, self.flag, self.at, self.calls = inner, flag, at, 0

    def forward(self, batch: dict) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            self.flag.signum = 15
        return self.inner(batch)


def _sft(tmp: Path, rank: int, model, flag: StopFlag, packs: list[dict], micro: int = 1) -> SFTStep:
    cfg = NS(train=NS(micro_batches_per_step=micro, max_grad_norm=1.0, max_consecutive_skipped_steps=5))
    cpu = torch.device("cpu")
    ctx = NS(cfg=cfg, env=NS(device=cpu, world_size=2, rank=rank, is_main=rank == 0), run_dir=tmp, stop=flag,
             device=cpu, to_device=_device_copy)
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=2), trainable_params=list(model.parameters()),
                moe_balancer=None, pipeline=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return SFTStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), Recorder(),
                   Positions(packs), total_steps=STEPS)


def _copied_to(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`collectives.to_device`, but a copy on the CPU too: a device tensor to the counter, whose reads count."""
    return torch.tensor(list(values), dtype=dtype).to(device, non_blocking=True, copy=True)


def _reads_per_step(step, packs: list[dict]) -> dict[int, tuple[int, str]]:
    """Host reads of each step (from its start to the next's: the loop's work after it included)."""
    reads = HostReads(host=[v for p in packs for v in p.values() if torch.is_tensor(v)])
    per_step: dict = {}

    def hook(k):
        reads.sites = per_step.setdefault(k, type(reads.sites)())

    with pytest.MonkeyPatch.context() as mp, reads:
        mp.setattr(collectives, "to_device", _copied_to)
        mp.setattr(signals, "to_device", _copied_to)
        assert run_loop(step.ctx, step, total_steps=STEPS, checkpointer=NoCheckpoints(), metrics=step.metrics,
                        log_every=1, before_step=hook) == 0
    return {k: (sum(c.values()), "\n".join(f"{n:4d} {kd:7s} {st}" for (kd, st), n in c.most_common()))
            for k, c in per_step.items()}


def _reads(tmp: Path, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    packs = [_pack(g, 9, 4 + rank) for _ in range(2 * STEPS)]
    torch.manual_seed(0)
    sft = _sft(tmp, rank, MaskFreeLM(), StopFlag(), packs, micro=2)
    pair_packs = _packs(10 + rank, 2 * STEPS)
    dpo = _dpo(tmp, PairLM(), pair_packs, micro=2)
    dpo.ctx.env = NS(device=torch.device("cpu"), world_size=2, rank=rank, is_main=rank == 0)
    for name, step, p in (("SFT", sft, packs), ("DPO", dpo, pair_packs)):
        per_step = _reads_per_step(step, p)
        for k in range(1, STEPS):  # the last step is followed by the loop's own stop read (nothing follows it)
            n, report = per_step[k]
            assert n == 2, f"{name} rank {rank}, step {k}: {n} host reads of device values (want 2):\n{report}"


def _stops(tmp: Path, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    packs = [_pack(g, 9, 4 + rank) for _ in range(STEPS)]
    pair_packs = _packs(20 + rank, STEPS)
    for kind, at in (("SFT", 2), ("SFT", STEPS), ("DPO", 2)):  # during a middle step; during the last one
        flag = StopFlag()
        torch.manual_seed(0)
        if kind == "SFT":
            model = StopDuring(MaskFreeLM(), flag, at if rank == 1 else 0)  # rank 1 alone receives the signal
            step = _sft(tmp, rank, model, flag, packs)
        else:
            model = StopDuring(PairLM(), flag, at if rank == 1 else 0)
            step = _dpo(tmp, model, pair_packs, micro=1)
            step.ctx.stop, step.loader = flag, Positions(pair_packs)
        moved = []
        step.optim.optimizer.register_step_post_hook(lambda o, a, k: moved.append(True))
        saves = Saves()
        code = run_loop(step.ctx, step, total_steps=STEPS, checkpointer=saves, metrics=step.metrics, log_every=1)
        rows = [s for split, s, _ in step.metrics.rows if split == "train"]
        why = (kind, rank, at, code, saves.saved, moved, rows, model.calls, step.loader.consumed)
        assert code == EXIT_STOPPED, why
        assert saves.saved == [(at, at)], why  # step `at`, with the data position after it
        assert len(moved) == at and rows == list(range(1, at + 1)), why
        assert model.calls == at and step.loader.consumed == at, why  # the next step's packs put back


def _ranks(tmp: Path, rank: int) -> None:
    _reads(tmp, rank)
    _stops(tmp, rank)


def test_two_ranks_read_twice_per_step_and_stop_together_after_the_step(tmp_path):
    """One spawn for both checks (starting two ranks is most of the time)."""
    spawn(tmp_path, _ranks)
