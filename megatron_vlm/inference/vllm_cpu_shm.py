"""The shared-memory segments of vLLM's CPU tensor-parallel communicator: one name per engine, released at close.

Why: vLLM's CPU build (0.32) runs the all-reduces of a tensor-parallel group through POSIX shared memory, one segment
per rank, named `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>` (`_CPUSHMDistributed.make_group_name` in
vllm/distributed/device_communicators/cpu_communicator.py; the rank suffix is added by its C++ `SHMManager`). Its CPU
worker sets VLLM_DIST_IDENT from the distributed init method, which for the external-launcher executor is always
"env://": the identifier is empty, so every tensor-parallel engine on a host asks for the same names, created with
O_EXCL ("create shm in SHMManager failed. errno: 17"). The segments are unlinked only by the `SHMManager` destructor
at process exit, so a second engine in the same process, a second job on the host, or a job restarted after a crash
(no destructor ran) could not start.

Here: while the engine is built, the group name gets a prefix unique to that engine (`ENGINE_PREFIX` and a random
token that rank 0 draws and sends to the job's ranks, so the ranks of one engine agree on it, as vLLM checks) and the
names are recorded; `release` unlinks this rank's segment when the engine closes (the mapping vLLM holds stays valid
until the process ends; its destructor's second unlink is ignored).
"""
from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator

import torch

__all__ = ["ENGINE_PREFIX", "unique_cpu_shm_names", "release"]

log = logging.getLogger("megatron_vlm")

ENGINE_PREFIX = "mvlm-"
"""How this package's engines' segment names begin (after the leading slash)."""


def _engine_token() -> str:
    """A token for one engine, the same on every rank of the job (each rank builds its engine at the same time)."""
    token = [secrets.token_hex(6)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(token, src=0)
    return str(token[0])


@contextlib.contextmanager
def unique_cpu_shm_names(enabled: bool) -> Iterator[list[str]]:
    """While vLLM builds a CPU tensor-parallel engine (`enabled`): every shared-memory group name it makes carries
    this engine's prefix. Yields the list that receives this rank's segment names (for `release`)."""
    names: list[str] = []
    if not enabled:
        yield names
        return
    from vllm.distributed.device_communicators import cpu_communicator

    cls = cpu_communicator._CPUSHMDistributed
    original = cls.__dict__["make_group_name"]
    prefix = ENGINE_PREFIX + _engine_token()

    def make_group_name(communicator) -> str:
        # vLLM's name begins with its (here empty) identifier; a slash inside a POSIX shm name is refused
        name = f"{prefix}-{original.__func__(communicator).replace('/', '').lstrip('-')}"
        segment = f"{name}_{communicator.rank}"
        if segment not in names:
            names.append(segment)
        return name

    cls.make_group_name = staticmethod(make_group_name)
    try:
        yield names
    finally:
        cls.make_group_name = original


def release(names: list[str]) -> None:
    """Unlink this rank's segments (`unique_cpu_shm_names`) once the engine is shut down; one already gone is fine."""
    import _posixshmem

    for name in names:
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass
        except OSError as e:  # never fail a close over it: the segment only outlives the engine
            log.warning("vLLM rollout: could not remove the shared-memory segment %s: %s", name, e)
    names.clear()
