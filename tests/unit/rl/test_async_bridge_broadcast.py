"""A control message of the asynchronous GRPO bridge reaches every rollout rank, however late one of them arrives, and
the trainer's send fails with an error naming a rollout rank that is gone (and the other rollout ranks' waits once the
trainer has ended).

Why: the trainer (bridge rank 0) broadcasts to N rollout ranks, so its send may start only once every one of them has
counted itself ready (the "ready" count of transfer n is n x N, rl/asynchronous/doorbell.py); were it to start at the
first one's count, a rollout rank still busy past the gloo timeout would fail the job, the failure the handshake is
there to prevent. The trainer waits on N peers at once, so a peer whose process is gone must end that wait too.

Three bridge ends in one process (threads, each with a store client of its own), a gloo timeout of 0.5 s."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_vlm.rl.asynchronous.bridge import Bridge, BridgeError

TIMEOUT_S = 0.5
LATE_S = 1.0  # twice the gloo timeout


def _ends(size: int, **kw) -> list[Bridge]:
    """Bridge ranks 0 .. size - 1 on one store, each with a client of its own."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ends: dict[int, object] = {}

    def make(rank: int) -> None:
        try:
            ends[rank] = Bridge(store.clone(), rank, size, TIMEOUT_S, **kw)
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


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_control_message_waits_for_every_rollout_rank():
    trainer, early, late = _ends(3)
    try:
        first, got_first = _in_thread(early.broadcast_object)
        sender, sent = _in_thread(lambda: trainer.broadcast_object({"kind": "want", "step": 1}))
        time.sleep(LATE_S)  # the second rollout rank is still busy (loading its model) past the gloo timeout
        got_late = late.broadcast_object()
        for t in (first, sender):
            t.join(30)
        assert "error" not in sent, sent
        assert got_first == {"value": {"kind": "want", "step": 1}}
        assert got_late == {"kind": "want", "step": 1}
        # and the next one, which the late rank waits for from the start, the early one joins late
        second, got_second = _in_thread(late.broadcast_object)
        sender, sent = _in_thread(lambda: trainer.broadcast_object({"kind": "stop", "signum": 0}))
        time.sleep(LATE_S)
        assert early.broadcast_object() == {"kind": "stop", "signum": 0}
        for t in (second, sender):
            t.join(30)
        assert "error" not in sent, sent
        assert got_second == {"value": {"kind": "stop", "signum": 0}}
    finally:
        for end in (trainer, early, late):
            end.close()


def test_the_trainers_send_fails_on_a_rollout_rank_without_a_sign_of_life():
    trainer, alive, gone = _ends(3, silent_s=0.5)
    try:
        gone.close()  # its process ended: no heartbeat any more, it will never count itself ready
        receiver, received = _in_thread(alive.broadcast_object)
        with pytest.raises(BridgeError, match="bridge rank 2"):
            trainer.broadcast_object({"kind": "want", "step": 0})
        trainer.close()  # the trainer's process ends with that error
        receiver.join(30)  # and the live rollout rank's wait for the others fails with the trainer's silence
        assert not receiver.is_alive()
        assert isinstance(received.get("error"), BridgeError), received
        assert "bridge rank 0" in str(received["error"])
    finally:
        trainer.close()
        alive.close()
