"""A control message of the asynchronous GRPO bridge reaches every rollout rank, however late one of them arrives, and
the trainer's send fails with an error naming a rollout rank that is gone (and the other rollout ranks' waits once the
trainer has ended); and a store whose host has gone fails a wait at once.

Why: the trainer (bridge rank 0) broadcasts to N rollout ranks; its send starts once every one of them has counted
itself ready (the "ready" count of transfer n is n x N, rl/asynchronous/doorbell.py), and a receiver must not post its
gloo receive before that either: the first rollout rank to arrive then waited in gloo for the last one, and a rank
that reached a message more than the gloo timeout after another (the first weight push, after each rank's own
start-up) failed a healthy job. The trainer waits on N peers at once, so a peer whose process is gone must end that
wait too.

Three bridge ends in one process (threads, each with a store client of its own), a gloo timeout of 0.5 s."""
from __future__ import annotations

import time

import pytest

from megatron_vlm.rl.asynchronous.bridge import Bridge, BridgeError
from tests.unit.rl.bridge_ends import bridge_ends, in_thread

TIMEOUT_S = 0.5
LATE_S = 1.0  # twice the gloo timeout


def _ends(size: int, **kw) -> list[Bridge]:
    """Bridge ranks 0 .. size - 1 on one store, each with a client of its own."""
    return bridge_ends(size, TIMEOUT_S, **kw)


def test_a_control_message_waits_for_every_rollout_rank():
    trainer, early, late = _ends(3)
    try:
        first, got_first = in_thread(early.broadcast_object)
        sender, sent = in_thread(lambda: trainer.broadcast_object({"kind": "want", "step": 1}))
        time.sleep(LATE_S)  # the second rollout rank is still busy (loading its model) past the gloo timeout
        got_late = late.broadcast_object()
        for t in (first, sender):
            t.join(30)
        assert "error" not in sent, sent
        assert got_first == {"value": {"kind": "want", "step": 1}}
        assert got_late == {"kind": "want", "step": 1}
        # and the next one, which the late rank waits for from the start, the early one joins late
        second, got_second = in_thread(late.broadcast_object)
        sender, sent = in_thread(lambda: trainer.broadcast_object({"kind": "stop", "signum": 0}))
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
        receiver, received = in_thread(alive.broadcast_object)
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


def test_a_wait_fails_at_once_when_the_launchers_store_is_gone():
    trainer, rollout, other = _ends(3, silent_s=60.0)  # a silence would be noticed only after a minute
    try:
        waiting, got = in_thread(rollout.broadcast_object)
        time.sleep(0.2)  # waiting for the trainer's next control message
        server = rollout.server  # type: ignore[attr-defined]
        for end in (trainer, rollout, other):
            del end.server  # type: ignore[attr-defined]
        del server  # the process that hosts the store ended (a trainer at rank 0 without torchrun's agent store)
        waiting.join(10)  # not after the minute of silence: the store's connection is closed
        assert not waiting.is_alive()
        assert isinstance(got.get("error"), BridgeError), got
        assert "launcher's store did not answer" in str(got["error"])
    finally:
        for end in (trainer, rollout, other):
            end.close()
