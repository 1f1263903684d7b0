"""One harness for the multi-process parallel tests: run a test body on N spawned CPU ranks of one gloo group.

The tp / cp / pp / ep / LoRA tests under tests/integration/parallel run their jobs in-process on a process group
(paying process start-up and imports once for many runs), so each needs the same scaffolding: spawn the ranks,
point them at one rendezvous (a free local port), keep them to one thread each (2-core CI), tear the group down,
and — because a failing rank otherwise only surfaces as "process 1 terminated with exit code 1" — send every
rank's traceback back to the parent and fail the test with them. Keeping that in one place means a fix to it
(a rendezvous race, a teardown abort) reaches every such test.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.parallel import init_distributed
from tests.integration.jobs import free_port


def _rank_main(rank: int, world: int, port: int, tmp: str, errors, part: Callable[[Path, int], None],
               init_group: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if init_group:
            init_distributed()
        part(Path(tmp), rank)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(tmp_path: Path, part: Callable[[Path, int], None], world: int = 2, *, init_group: bool = True) -> None:
    """Run `part(tmp_path, rank)` on `world` spawned ranks; a rank's traceback becomes the assertion message.

    `part` must be a module-level function (it is pickled by reference into the spawned processes). With
    `init_group` the ranks join the `world`-rank group (`init_distributed`, gloo on CPU) before `part` runs;
    without it `part` creates the group itself (the rendezvous variables are set), e.g. after rank 0 has run a
    one-process reference in a group of its own."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_rank_main, args=(world, free_port(), str(tmp_path), errors, part, init_group),
                           nprocs=world, start_method="spawn")
    except Exception as err:
        msgs = []
        while not errors.empty():
            rank, tb = errors.get()
            msgs.append(f"rank {rank}:\n{tb}")
        raise AssertionError("\n".join(msgs) or "a worker failed") from err
