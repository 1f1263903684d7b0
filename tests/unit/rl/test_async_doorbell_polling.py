"""A long wait of the asynchronous GRPO bridge for the next message polls the launcher's store less and less often,
while a short one, and every wait for a peer about to arrive, keeps answering within 10 ms.

Why: every rollout rank's weight thread waits for the trainer's next control message through each whole training
step, and the trainer's receive waits for a step to be generated. At a fixed 10 ms poll, 256 rollout ranks read the
store 25,600 times a second, step after step: the order of what one store core serves (a libuv TCPStore, measured
at 20,000-30,000 adds/s on a loaded 2-core machine), on the store that also carries torchrun's rendezvous and every
process group's set-up. A wait that has already lasted t seconds now polls at most every max(10 ms, t / 100) (at
most every 100 ms): the latency it adds stays within 1 % of the wait, the load of a minute-long wait falls ~7x.

A fake clock (the doorbell's `time`) and a fake store: the count the wait is for arrives after 60 s; the polls of
it are counted. Hand-derived: 10 ms polls for 60 s are ~6,000; 10 ms for the first second, then t / 100 up to 10 s
(100 x ln 10 ~ 230 polls), then 100 ms for 50 s (500) are ~830."""
from __future__ import annotations

import threading

from megatron_vlm.rl.asynchronous import doorbell
from megatron_vlm.rl.asynchronous.doorbell import Doorbells


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class _Store:
    """`key` reaches 1 at `at` seconds of the fake clock; heartbeats always move; polls of `key` counted."""

    def __init__(self, clock: _Clock, key: str, at: float):
        self.clock, self.key, self.at, self.polls, self.beats = clock, key, at, 0, 0
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            if key == self.key:
                self.polls += 1
                return int(self.clock.now >= self.at)
            self.beats += 1  # a live peer's heartbeat (and this process's own)
            return self.beats


def _wait(monkeypatch, at: float, patient: bool = True) -> tuple[int, float]:
    clock = _Clock()
    monkeypatch.setattr(doorbell, "time", clock)
    store = _Store(clock, "weights/sent", at)
    bells = Doorbells(store, 1, ("weights",), silent_s=1800.0)
    try:
        bells.wait_for("weights", "weights/sent", 1, (0,), patient=patient)
    finally:
        bells.close()
    return store.polls, clock.now


def test_a_minute_long_wait_polls_the_store_a_fraction_as_often(monkeypatch):
    polls, returned = _wait(monkeypatch, at=60.0)
    assert polls < 1200, polls  # ~830 (module docstring); 10 ms polls: ~6,000
    assert 60.0 <= returned <= 60.0 + 0.1 + 1e-6, returned  # noticed within 100 ms (1 % of the wait caps it lower)


def test_a_short_wait_still_answers_within_10_ms(monkeypatch):
    _, returned = _wait(monkeypatch, at=0.5)
    assert 0.5 <= returned <= 0.5 + 0.01 + 1e-6, returned


def test_a_wait_for_a_peer_about_to_arrive_keeps_answering_within_10_ms(monkeypatch):
    # a rollout rank's samples wait for the trainer's receives of the ranks before it: its latency adds up over them
    _, returned = _wait(monkeypatch, at=60.0, patient=False)
    assert 60.0 <= returned <= 60.0 + 0.01 + 1e-6, returned
