"""The bridge of asynchronous GRPO waits for a busy peer as long as that peer is alive, and fails on one that is gone.

Before: every wait for the next message was a gloo receive under the bridge's timeout (1800 s), so a healthy peer that
was simply busy for longer killed the job: the rollout ranks' wait for the trainer's next control message through a
long held-out evaluation (`rl.eval.at_start` with k = 8 x 16384 tokens on the Geometry3K config), a checkpoint and
export, or the trainer's start-up (a large prompt set measured, a large model loaded); the trainer's wait for a step
that takes that long to generate. A resumed run evaluates the missing step again first, so it failed the same way.

Two bridge ends in one process (threads, each with its own store client), a gloo timeout of 1 s: a message sent 2 s
after its receiver began to wait arrives, in both directions; a peer whose process gives no sign of life (its
heartbeat stops) still fails the wait with an error naming the bridge rank."""
from __future__ import annotations

import time

import pytest

from megatron_vlm.rl.asynchronous.bridge import Bridge, BridgeError
from tests.unit.rl.bridge_ends import bridge_ends, in_thread

BUSY_S = 2.0
TIMEOUT_S = 1.0


def _pair(**kw) -> tuple[Bridge, Bridge]:
    """Bridge rank 0 (the trainer) and 1 (a rollout rank) on one store, each with a client of its own."""
    trainer, rollout = bridge_ends(2, TIMEOUT_S, **kw)
    return trainer, rollout


def test_a_busy_peer_is_waited_for_past_the_bridge_timeout():
    trainer, rollout = _pair()
    try:
        # the rollout rank waits for the next control message, the trainer for the rollout rank's samples
        control, got_control = in_thread(rollout.broadcast_object)
        samples, got_samples = in_thread(lambda: trainer.recv_object(1))
        time.sleep(BUSY_S)  # both peers busy (an evaluation, a long generation) for twice the timeout
        sender, sent = in_thread(lambda: rollout.send_object({"step": 3, "samples": []}))
        trainer.broadcast_object({"kind": "want", "step": 4})
        for t in (control, samples, sender):
            t.join(30)
        assert got_control == {"value": {"kind": "want", "step": 4}}
        assert got_samples == {"value": {"step": 3, "samples": []}}
        assert "error" not in sent, sent
    finally:
        trainer.close()
        rollout.close()


def test_a_peer_without_a_sign_of_life_fails_the_wait():
    trainer, rollout = _pair(silent_s=0.5)
    try:
        trainer.close()  # its process ended: no heartbeat any more, no message will come
        with pytest.raises(BridgeError, match="bridge rank 0"):
            rollout.broadcast_object()
    finally:
        rollout.close()
