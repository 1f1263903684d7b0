"""The loops' collectives on two ranks (megatron_vlm/parallel/collectives.py, `StopFlag.should_stop`): the values
go to the device without a blocking upload, so the read back is each call's one sync.

On CUDA a tensor made on the device from a Python list (`torch.tensor(values, device=...)`) waits for every kernel
queued before it, as a read does; every step of a multi-rank job sums its token and sample counts and asks whether
any rank was told to stop, so each of those calls waited twice. Counted on the CPU with `HostReads` (where a
`non_blocking` move to the CPU is the tensor itself, the read back is not seen: the uploads are what this checks).
The values are the sums and maxima over the ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_vlm.parallel.collectives import all_reduce_max, all_reduce_sum, any_rank
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training.signals import StopFlag
from tests.integration.parallel.spawn import spawn

pytestmark = [pytest.mark.distributed]


def _ranks(tmp: Path, rank: int) -> None:  # noqa: ARG001
    cpu = torch.device("cpu")
    flag = StopFlag()
    with HostReads() as reads:
        sums = all_reduce_sum([1.5 + rank, 2**40 + rank], cpu)
        maxes = all_reduce_max([3 * rank, -rank], cpu)
        anyone = any_rank(rank == 1, cpu), any_rank(False, cpu)
        flag.signum = 15 if rank == 0 else 0
        stop = flag.should_stop(cpu)
    uploads = {site: n for (kind, site), n in reads.sites.items() if kind == "upload"}
    assert not uploads, f"rank {rank}: blocking uploads:\n{reads.report()}"
    assert sums == [4.0, float(2 * 2**40 + 1)] and maxes == [3, 0] and anyone == (True, False) and stop


def test_collectives_upload_without_waiting(tmp_path):
    spawn(tmp_path, _ranks)
