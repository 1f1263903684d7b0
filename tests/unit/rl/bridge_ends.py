"""Ends of the asynchronous GRPO bridge in one test process: one thread per bridge rank at set-up, each end with a
store client of its own, and a helper running a bridge call in a thread whose result or error the test reads."""
from __future__ import annotations

import threading

import torch.distributed as dist

from megatron_vlm.rl.asynchronous.bridge import Bridge


def bridge_ends(size: int, timeout_s: float, **kw) -> list[Bridge]:
    """Bridge ranks 0 .. size - 1 on one store (0: the trainer), gloo timeout `timeout_s`; `kw` go to Bridge."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ends: dict[int, object] = {}

    def make(rank: int) -> None:
        try:
            ends[rank] = Bridge(store.clone(), rank, size, timeout_s, **kw)
        except Exception as e:  # noqa: BLE001 - reported below
            ends[rank] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(ends.get(r), Bridge) for r in range(size)), ends
    for end in ends.values():
        end.server = store  # type: ignore[union-attr] # the store's server lives as long as its master object
    return [ends[r] for r in range(size)]  # type: ignore[misc]


def in_thread(fn):
    """Run `fn` in a daemon thread: (the thread, a dict that gets "value" or "error")."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
