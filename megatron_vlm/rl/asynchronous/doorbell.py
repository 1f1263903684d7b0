"""Announced transfers on the bridge of asynchronous GRPO: a gloo transfer starts only once both of its ends have
arrived, and the wait for the other end lasts as long as that end's process shows a sign of life.

Why: a gloo receive fails when its group's timeout passes, however healthy the sender. The bridge's waits for the
next message are long by design: a rollout rank waits for the trainer's next control message through the trainer's
start-up, each training step, a held-out evaluation (`rl.eval.at_start`, k samples of every held-out prompt),
checkpoints and the export; the trainer waits for a step that takes its rollout ranks that long to generate. Under
the bridge's 1800 s timeout such a phase killed a healthy job, and its resumed run (which evaluates the missing step
first) failed the same way.

How: each side of a transfer counts it on the launcher's store before the transfer (`ring`): the sender's "sent"
count, then each receiver's "ready" count; a side posts its gloo call once the other side's count has reached that
transfer (`wait_for`) and, a receiver of a broadcast, once every receiver has counted it ready, so the gloo call
itself waits only for the data, within the timeout. While it waits it reads
the other ends' heartbeats: every bridge process adds 1 to its own "alive" count every `beat_s` seconds from a
thread of its own (`Doorbells`), and a peer whose count has not moved for `silent_s` seconds (its process ended,
was killed, or its node is gone) ends the wait with `PeerSilent`. The store is only read by short calls (no
blocking wait), each thread's through its own channel's client, polled every few milliseconds; a wait for the next
message polls less often as it goes on (at most every 100 ms, and within 1 % of the wait).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Doorbells", "PeerSilent"]

_POLL_MIN_S, _POLL_MAX_S = 0.0005, 0.01
"""The polling interval of a wait: doubling from the first up to the second (the latency a handshake adds)."""
_POLL_LONG_FRACTION, _POLL_LONG_MAX_S = 0.01, 0.1
"""A wait that has lasted t seconds polls at most every max(_POLL_MAX_S, t x the fraction), up to the second: a long
wait (a rollout rank's for the trainer's next message, through a whole training step) adds at most 1 % of itself
as latency, and N rollout ranks do not poll the launcher's store N x 100 times a second step after step."""


class PeerSilent(RuntimeError):
    """A peer gave no sign of life (no heartbeat) for `silent_s` seconds while it was waited for."""

    def __init__(self, peer: int, silent_s: float):
        super().__init__(f"bridge rank {peer} gave no sign of life for {silent_s:g} s (its process ended, was killed "
                         "or hangs)")
        self.peer = peer


def _client(store: Any) -> Any:
    """A store client of its own (a connection that no other thread's call waits behind), where the store can make one."""
    clone = getattr(store, "clone", None)
    return clone() if clone is not None else store


class Doorbells:
    """The counts and heartbeats of one bridge process (`rank`) on `store`; `channels`: the names whose transfers it
    announces (each used by one thread at a time, with a store client of its own); `silent_s`: how long a peer that
    is waited for may show no heartbeat (the bridge's timeout: generous, as a thread starved by a call that holds the
    interpreter for a while, a large export's serialisation, must not pass for a dead process)."""

    def __init__(self, store: Any, rank: int, channels: Iterable[str], *, silent_s: float):
        if silent_s <= 0:
            raise ValueError(f"silent_s: must be > 0, got {silent_s}")
        self.rank, self.silent_s = rank, float(silent_s)
        self.beat_s = min(1.0, self.silent_s / 5)
        self._clients = {name: _client(store) for name in channels}
        self._beat_client = _client(store)
        self._beat_client.add(f"alive/{rank}", 1)  # a sign of life before the first wait of any peer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="bridge-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._beat_client.add(f"alive/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending; the peers' waits say so
                return

    def close(self) -> None:
        """Stop the heartbeat (the peers then see this process as gone)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def ring(self, channel: str, key: str) -> int:
        """Count one more transfer on `key` (a "sent" or "ready" count); the count after it."""
        return int(self._clients[channel].add(key, 1))

    def wait_for(self, channel: str, key: str, count: int, peers: Iterable[int], *, patient: bool = False) -> None:
        """Return once `key` has reached `count`; `PeerSilent` when one of `peers` shows no heartbeat for `silent_s`
        meanwhile. `patient`: a wait for a peer that may be busy for long (the next message), which polls less often
        as it goes on (`_POLL_LONG_FRACTION`); the other waits (for a peer about to arrive, where the trainer's
        receives from one rollout rank after another would add up their latencies) poll every `_POLL_MAX_S`."""
        kv = self._clients[channel]
        seen: dict[int, tuple[int, float]] = {}
        delay, next_check, start = _POLL_MIN_S, 0.0, time.monotonic()
        while int(kv.add(key, 0)) < count:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.beat_s
                for p in peers:
                    beats = int(kv.add(f"alive/{p}", 0))
                    last = seen.get(p)
                    if last is None or beats != last[0]:
                        seen[p] = (beats, now)
                    elif now - last[1] >= self.silent_s:
                        raise PeerSilent(p, self.silent_s)
            time.sleep(delay)
            longest = _POLL_MAX_S
            if patient:
                longest = max(longest, min(_POLL_LONG_MAX_S, (time.monotonic() - start) * _POLL_LONG_FRACTION))
            delay = min(2 * delay, longest)
