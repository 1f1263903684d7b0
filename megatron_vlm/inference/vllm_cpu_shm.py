"""The shared-memory segments of vLLM's CPU tensor-parallel communicator: one name per engine, released at close.

Why: vLLM's CPU build (0.32) runs the all-reduces of a tensor-parallel group through POSIX shared memory, one segment
per rank, named `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>` (`_CPUSHMDistributed.make_group_name` in
vllm/distributed/device_communicators/cpu_communicator.py; the rank suffix is added by its C++ `SHMManager`). Its CPU
worker sets VLLM_DIST_IDENT from the distributed init method, which for the external-launcher executor is always
"env://": the identifier is empty, so every tensor-parallel engine on a host asks for the same names, created with
O_EXCL ("create shm in SHMManager failed. errno: 17"). The segments are unlinked only by the `SHMManager` destructor
at process exit, so a second engine in the same process, a second job on the host, or a job restarted after a crash
(no destructor ran) could not start.

Here, while the engine is built (`unique_cpu_shm_names`): the group name gets a prefix unique to that engine
(`ENGINE_PREFIX` and a random token that rank 0 draws and sends to the job's ranks, so the ranks of one engine agree on
it, as vLLM checks), and each rank takes a shared `flock` on its segment as soon as vLLM has made it, held while the
engine lives. `release` unlinks the segment when the engine closes (the mapping vLLM holds stays valid until the
process ends; its destructor's second unlink is ignored). A process that dies without closing its engine (killed,
crashed) leaves its segment behind: no later engine trips over it, but it holds memory, so an engine starting removes
such leftovers (`sweep_stale`): segments of our prefix that nobody holds locked — the kernel drops a dead process's
locks, a live engine's stay — and older than a minute (a segment is locked a moment after it is made).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["ENGINE_PREFIX", "EngineSegments", "unique_cpu_shm_names", "release", "sweep_stale"]

log = logging.getLogger("megatron_vlm")

ENGINE_PREFIX = "mvlm-"
"""How this package's engines' segment names begin (after the leading slash)."""
SHM_DIR = Path("/dev/shm")
"""Where Linux keeps the POSIX shared-memory segments (a tmpfs)."""
_OURS = re.compile(re.escape(ENGINE_PREFIX) + r"[0-9a-f]+-.*-cpushm_\d+")


@dataclass
class EngineSegments:
    """This rank's segments of one engine: name -> the descriptor holding its lock."""

    held: dict[str, int] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.held)

    def hold(self, name: str) -> None:
        """Lock the segment `name` (shared) for as long as the engine lives (`sweep_stale` leaves it alone)."""
        if name in self.held:
            return
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
        except OSError as e:  # not under /dev/shm here: it is still unlinked at close
            log.debug("vLLM rollout: shared-memory segment %s not lockable: %s", name, e)
            self.held[name] = -1
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.held[name] = fd


def _engine_token() -> str:
    """A token for one engine, the same on every rank of the job (each rank builds its engine at the same time)."""
    token = [secrets.token_hex(6)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(token, src=0)
    return str(token[0])


@contextlib.contextmanager
def unique_cpu_shm_names(enabled: bool) -> Iterator[EngineSegments]:
    """While vLLM builds a CPU tensor-parallel engine (`enabled`): every shared-memory group name it makes carries
    this engine's prefix, and each segment this rank makes is locked at once. Yields this rank's segments (for
    `release`)."""
    segments = EngineSegments()
    if not enabled:
        yield segments
        return
    from vllm.distributed.device_communicators import cpu_communicator

    sweep_stale()
    cls = cpu_communicator._CPUSHMDistributed
    make_name, init_shm = cls.__dict__["make_group_name"], cls.__dict__["_init_cpu_shm"]
    prefix = ENGINE_PREFIX + _engine_token()

    def make_group_name(communicator) -> str:
        # vLLM's name begins with its (here empty) identifier; a slash inside a POSIX shm name is refused
        return f"{prefix}-{make_name.__func__(communicator).replace('/', '').lstrip('-')}"

    def _init_cpu_shm(self) -> int:
        handle = init_shm(self)
        segments.hold(f"{self.group_name}_{self.communicator.rank}")  # the name vLLM's C++ side gives this rank's
        return handle

    cls.make_group_name, cls._init_cpu_shm = staticmethod(make_group_name), _init_cpu_shm
    try:
        yield segments
    finally:
        cls.make_group_name, cls._init_cpu_shm = make_name, init_shm


def release(segments: EngineSegments) -> None:
    """Unlink this rank's segments (`unique_cpu_shm_names`) once the engine is shut down; one already gone is fine."""
    import _posixshmem

    for name, fd in segments.held.items():
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass
        except OSError as e:  # never fail a close over it: the segment only outlives the engine
            log.warning("vLLM rollout: could not remove the shared-memory segment %s: %s", name, e)
        if fd >= 0:
            os.close(fd)
    segments.held.clear()


def sweep_stale(min_age_s: float = 60.0) -> list[str]:
    """Unlink the segments of this package's engines that no live engine holds locked and that are older than
    `min_age_s` (module docstring); the names removed."""
    try:
        candidates = [p for p in SHM_DIR.iterdir() if _OURS.fullmatch(p.name)]
    except OSError:
        return []
    removed = []
    for p in candidates:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age_s:
                continue  # maybe being made: its engine locks it a moment later
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live engine's
            os.unlink(p)
            removed.append(p.name)
        except FileNotFoundError:  # another rank swept it first
            continue
        except OSError as e:
            log.warning("vLLM rollout: could not remove the stale shared-memory segment %s: %s", p, e)
        finally:
            os.close(fd)
    if removed:
        log.info("vLLM rollout: removed %d shared-memory segments of engines whose processes ended: %s", len(removed),
                 ", ".join(removed))
    return removed
