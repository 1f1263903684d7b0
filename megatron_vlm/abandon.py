"""Giving up a wait when the rank is stopping: `Patience` (a stop check with a grace) and `WaitAbandoned`.

Why a module of its own: the reward / environment pools (rl/rewards/pool.py), the rollout engine's decode loop
(inference/) and the model rewards all give up their waits the same way, and the inference package must not import
the RL package. Only the standard library: reward workers unpickle `WaitAbandoned` without torch.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

__all__ = ["ABANDON_POLL_S", "ABANDON_GRACE_S", "Patience", "WaitAbandoned"]

ABANDON_POLL_S = 0.25
"""How often a waiting `map` asks its `abandon` check."""
ABANDON_GRACE_S = 2.0
"""How long a wait goes on after its `abandon` check first said stop (`Patience`)."""


class Patience:
    """`check` wrapped for one wait: True once `check()` has said stop for `grace_s` (ABANDON_GRACE_S) of the wait.

    Why a grace: a stop signal that arrives while a batch is about to end (or just before it starts) should let that
    batch end and its step be kept; only a wait that goes on gives up."""

    def __init__(self, check: Callable[[], bool], grace_s: Optional[float] = None):
        self.check, self.grace_s = check, ABANDON_GRACE_S if grace_s is None else grace_s
        self.since: Optional[float] = None

    def __call__(self) -> bool:
        if self.since is None:
            if not self.check():
                return False
            self.since = time.monotonic()
        return time.monotonic() - self.since >= self.grace_s


class WaitAbandoned(BaseException):
    """`map`'s `abandon` check said stop: the batch was given up, its calls in flight killed (no result is kept).
    `waited_for`: what the wait was for ("verifiers", "environments": the pool's `waits_for`), so that the step or
    evaluation given up says which wait hung.

    A BaseException, as KeyboardInterrupt, so that no `except Exception` of the layers between the pool and the
    step (a user's environment session, a scorer's guard) turns it into an error result."""

    def __init__(self, detail: str, *, waited_for: str):
        super().__init__(detail)
        self.waited_for = waited_for

    def __reduce__(self):  # the keyword argument survives a pickle round trip
        return _wait_abandoned, (str(self), self.waited_for)

    @classmethod
    def of(cls, n: int, waited_for: str) -> WaitAbandoned:
        """`n` calls to `waited_for` ("verifiers" / "environments") given up."""
        kind = {"verifiers": "verifier", "environments": "environment"}.get(waited_for, waited_for)
        return cls(f"{n} {kind} call{'s' if n != 1 else ''} given up: the rank is stopping", waited_for=waited_for)


def _wait_abandoned(detail: str, waited_for: str) -> WaitAbandoned:
    return WaitAbandoned(detail, waited_for=waited_for)
