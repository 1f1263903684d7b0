"""The processes of an asynchronous GRPO job: their roles, their own process groups, and the bridge
between the training rank 0 and the rollout ranks.

Why separate default groups: everything the trainer runs (FSDP, the loop's stop all-reduce, metric
gathers, checkpoints) uses the default process group and must not wait for ranks that are busy
generating. `setup_roles(cfg)` therefore, before anything else touches torch.distributed, meets all
processes once on the launcher's store (`env://`), gives each role its own default group on a
prefixed view of that store (the training ranks see a world of M ranks, the rollout ranks one of N),
and builds two bridge groups over {training rank 0} + {the rollout ranks} (bridge rank 0 = training
rank 0, bridge rank 1 + r = rollout rank r):

- `weights`: broadcasts from the trainer — control messages (pickled) and the weights, one tensor
  at a time, received by the rollout ranks straight into their model (no full staging copy);
- `samples`: point-to-point from each rollout rank to the trainer: one message per step with the
  step's completed, scored groups.

Both are gloo groups (CPU tensors; on an accelerator a tensor is staged through host memory one
tensor at a time). Each message is announced on the launcher's store before its transfer
(rl/asynchronous/doorbell.py): a side posts its gloo call once every other end of the transfer has arrived (a
broadcast's receivers wait for each other too: the first to arrive must not wait in gloo for the last), so the wait for the next
message (the trainer's start-up, a training step, a held-out evaluation, a checkpoint or the export on one side; the
generation of a step on the other) lasts as long as the peer is alive, however long, and only the transfer itself
is bounded by `timeout_s`. A peer whose process ends (or hangs in a transfer) makes the waiting side fail: no
heartbeat for `timeout_s` while it is waited for (a heartbeat thread of its own, so a long evaluation or export does
not silence it), a closed connection or the timeout within a transfer; the caller turns that into an error naming
the bridge, the job stops (torchrun ends it sooner when a process exits).
"""
from __future__ import annotations

import datetime
import os
import pickle
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.asynchronous.allocation import ALLOCATION_GRAMMAR, Allocation, parse_allocation
from megatron_vlm.rl.asynchronous.doorbell import Doorbells, PeerSilent

__all__ = ["Bridge", "Role", "setup_roles", "current_role", "BridgeError"]

_ROLE: Optional[Role] = None


class BridgeError(RuntimeError):
    """A peer of the bridge died or did not answer within the timeout."""


class Bridge:
    """Messages and tensors between training rank 0 (bridge rank 0) and the rollout ranks (1 .. N)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, *, silent_s: Optional[float] = None):
        """`timeout_s`: the limit of one transfer once both ends are there, and (unless `silent_s` says otherwise) how
        long a peer that is waited for may show no heartbeat before it counts as gone (module docstring)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        # gloo groups used through their own broadcast / send / recv (torch's stubs do not list those methods)
        self.weights: Any = dist.ProcessGroupGloo(dist.PrefixStore("mvlm_async/weights", store), rank, size, timeout)
        self.samples: Any = dist.ProcessGroupGloo(dist.PrefixStore("mvlm_async/samples", store), rank, size, timeout)
        self.bells = Doorbells(dist.PrefixStore("mvlm_async/bells", store), rank, ("weights", "samples"),
                               silent_s=timeout_s if silent_s is None else silent_s)
        self._sequence: Counter[str] = Counter()
        """Transfers announced so far per count key (each side counts its own; both count alike)."""

    def close(self) -> None:
        """Stop this end's heartbeat (at the end of its process; the tests' ends of a bridge)."""
        self.bells.close()

    def _announce(self, channel: str, key: str, sender: int, receivers: tuple[int, ...], *, what: str) -> None:
        """Before transfer number n on `key` (each side counts its own) from bridge rank `sender` to `receivers`: the
        sender counts it sent and waits until every receiver has counted it ready; a receiver waits until the sender
        has counted it sent, counts itself ready, then (a broadcast) waits until every other receiver has too. All gloo
        calls of the transfer then start together (module docstring): a receiver's call does not wait for the slowest
        receiver to arrive, which the transfer's timeout would not allow. A silent peer, or a store that fails, is a
        `BridgeError` naming the bridge."""
        n = self._sequence[key] + 1
        self._sequence[key] = n
        try:
            if self.rank == sender:
                self.bells.ring(channel, f"{key}/sent")
                self.bells.wait_for(channel, f"{key}/ready", n * len(receivers), receivers)
            else:
                self.bells.wait_for(channel, f"{key}/sent", n, (sender,), patient=True)  # however busy the sender
                if self.bells.ring(channel, f"{key}/ready") < n * len(receivers):
                    # the sender watches the receivers' heartbeats; one that is gone fails its wait, and its silence
                    # then fails this one (reading every receiver's heartbeat here would cost N x N store reads)
                    self.bells.wait_for(channel, f"{key}/ready", n * len(receivers), (sender,))
        except PeerSilent as e:
            raise BridgeError(f"asynchronous GRPO: {what} failed: {e}") from None
        except RuntimeError as e:  # the launcher's store did not answer (its host is gone): the job is ending
            raise BridgeError(f"asynchronous GRPO: {what} failed: the launcher's store did not answer: {e}") from None

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise BridgeError(f"asynchronous GRPO: {what} failed (a peer process died or did not answer "
                              f"within {self.timeout_s:g} s): {e}") from None

    # ---- broadcasts from the trainer (bridge rank 0) ----
    def broadcast_object(self, obj: Any = None) -> Any:
        """Bridge rank 0 sends `obj`; every other rank returns it (waiting for it as long as rank 0 lives)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            n = torch.zeros(1, dtype=torch.int64)
        self._announce("weights", "weights", 0, tuple(range(1, self.size)), what="control message")
        self._wait(self.weights.broadcast(n, 0), "control message")
        if self.rank != 0:
            data = torch.empty(int(n), dtype=torch.uint8)
        self._wait(self.weights.broadcast(data, 0), "control message")
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def broadcast_tensor_(self, tensor: torch.Tensor, what: str = "weight push") -> None:
        """In place: bridge rank 0's `tensor` into every rank's (CPU, contiguous). Not announced: the tensors of a push
        follow its control message, which every rank has received."""
        self._wait(self.weights.broadcast(tensor, 0), what)

    # ---- rollout rank -> trainer ----
    def send_object(self, obj: Any, dst: int = 0) -> None:
        """To bridge rank `dst` (the trainer), once it is ready to receive it."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._announce("samples", f"samples/{self.rank}", self.rank, (dst,), what="sending samples")
        self._wait(self.samples.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0), "sending samples")
        self._wait(self.samples.send([data], dst, 1), "sending samples")

    def recv_object(self, src: int) -> Any:
        """From bridge rank `src` (rollout rank src - 1), waiting for it as long as that rank lives."""
        what = f"receiving samples from rollout rank {src - 1}"
        self._announce("samples", f"samples/{src}", src, (self.rank,), what=what)
        n = torch.zeros(1, dtype=torch.int64)
        self._wait(self.samples.recv([n], src, 0), what)
        data = torch.empty(int(n), dtype=torch.uint8)
        self._wait(self.samples.recv([data], src, 1), what)
        return pickle.loads(data.numpy().tobytes())


@dataclass
class Role:
    name: str
    """"train" or "rollout"."""
    rank: int
    """Rank within the role (= the process's rank in its default group)."""
    allocation: Allocation
    global_rank: int
    bridge: Optional[Bridge]
    """Training rank 0 and every rollout rank; None on the other training ranks."""

    @property
    def is_rollout(self) -> bool:
        return self.name == "rollout"


def current_role() -> Optional[Role]:
    """The role `setup_roles` gave this process (None: not an asynchronous job)."""
    return _ROLE


def setup_roles(cfg, timeout_s: float = 1800.0) -> Optional[Role]:
    """Split the processes by `cfg.rl.allocation` (module docstring); None without it. ValueError
    naming the key (the launcher: config error, exit 2) when N + M differs from the number of processes. Afterwards RANK / WORLD_SIZE describe the role's own
    world, so `parallel.dist.init_distributed` returns the role's environment."""
    global _ROLE
    rl = getattr(cfg, "rl", None)
    if cfg.train.mode != "grpo" or rl is None or rl.allocation is None:
        return None
    alloc = parse_allocation(rl.allocation)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world != alloc.world_size:
        raise ConfigError(f"rl.allocation: {rl.allocation!r} asks for {alloc.rollout} rollout + {alloc.train} training "
                          f"= {alloc.world_size} processes, but the job has {world} ({ALLOCATION_GRAMMAR}; launch "
                          f"with torchrun --nproc_per_node {alloc.world_size} or change the sizes)")
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("rl.allocation: an asynchronous job needs several processes; launch it with torchrun")
    name, role_rank = alloc.role_of(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    from megatron_vlm.parallel.dist import detect_device

    _, backend = detect_device(int(os.environ.get("LOCAL_RANK", 0)), os.environ.get("MEGATRON_VLM_DEVICE", "auto"))
    size = alloc.train if name == "train" else alloc.rollout
    dist.init_process_group(backend, store=dist.PrefixStore(f"mvlm_async/{name}", store), rank=role_rank,
                            world_size=size, timeout=timeout)
    bridge = None
    if name == "rollout" or role_rank == 0:
        bridge = Bridge(store, 0 if name == "train" else 1 + role_rank, 1 + alloc.rollout, timeout_s)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(role_rank), str(size)
    _ROLE = Role(name=name, rank=role_rank, allocation=alloc, global_rank=rank, bridge=bridge)
    return _ROLE
