"""Give up work that hangs on the main thread once the rank is stopping: the in-process environment runner's wait.

Why a signal: the in-process runner (`[rl.env] sandbox = false`) runs an environment's calls on the rank's main
thread, where nothing ends a hung call from outside as a worker process is killed. Running each call in a thread that
could be abandoned (as a hung video decode is, data/media.py) would take the SIGALRM deadline from its tools (main
thread only, rl/env/tools.py) and leave the call running beside the checkpoint save. Instead, inside `interruptible`,
a watcher thread asks the stop check (with its grace: abandon.py `Patience`); once it says give up, the watcher
sends SIGUSR2 to the main thread, whose handler raises the given exception (`WaitAbandoned`) in the call: a call that
sleeps, waits on a socket or a subprocess, or loops in Python unwinds there (its `finally` blocks run), as a tool at its
deadline does. The step is then abandoned, so the environment's half-changed state is never used.

What it cannot end (the tool deadline's limits): a call blocked in C code that does not return to Python (the handler
runs when it does) and one that catches BaseException and goes on. Outside the main thread no handler can run in the
call: the block is then not interruptible (the runner checks between calls only).

SIGUSR2: neither a stop signal (TERM, USR1: training/signals.py) nor the tool deadline's SIGALRM. The handler is
installed the first time a block needs it and stays (putting the default back, which ends the process, would let a
signal sent just as a block ended kill the rank); a SIGUSR2 that is not the watcher's goes to the handler that was
there before, and is ignored when that was the default. The handler raises once per block and then disarms it, so
signals still on their way when the call has ended raise nothing.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

from megatron_vlm.abandon import ABANDON_POLL_S

__all__ = ["INTERRUPT_SIGNAL", "interruptible"]

INTERRUPT_SIGNAL = signal.SIGUSR2 if hasattr(signal, "SIGUSR2") else None
"""The signal the watcher sends to the main thread (None: a platform without it; blocks are then not interruptible)."""


class _Block:
    """One `interruptible` block: the exception to raise in it."""

    def __init__(self, make_error: Callable[[], BaseException]):
        self.make_error = make_error


class _State:
    active: Optional[_Block] = None
    """The block running on the main thread (None: none, or its exception already raised)."""
    firing: Optional[_Block] = None
    """The block the watcher sent the signal for."""
    previous: Any = None
    """The handler the signal had before this module's (called for a signal that is not the watcher's)."""
    installed = False


_state = _State()


def _handle(signum: int, frame: Any) -> None:
    block = _state.active
    if block is not None and _state.firing is block:
        _state.active = None  # raised once: the block is disarmed
        raise block.make_error()
    if callable(_state.previous):
        _state.previous(signum, frame)


def _can_interrupt() -> bool:
    return (INTERRUPT_SIGNAL is not None and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread())


@contextlib.contextmanager
def interruptible(give_up: Callable[[], bool], make_error: Callable[[], BaseException]) -> Iterator[bool]:
    """Inside (on the main thread): once `give_up()` (asked every ABANDON_POLL_S from another thread) returns True,
    `make_error()` is raised in whatever the main thread runs. Yields whether the block can be interrupted (False off
    the main thread: the caller checks `give_up` itself where it can)."""
    if not _can_interrupt():
        yield False
        return
    assert INTERRUPT_SIGNAL is not None
    if not _state.installed:
        _state.previous = signal.signal(INTERRUPT_SIGNAL, _handle)
        _state.installed = True
    block = _Block(make_error)
    done = threading.Event()
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        while not done.wait(ABANDON_POLL_S) and _state.active is block:
            if give_up():
                _state.firing = block
                signal.pthread_kill(main, INTERRUPT_SIGNAL)  # again each poll until it has raised or the block ended

    _state.active = block
    watcher = threading.Thread(target=watch, name="megatron-vlm-stop-watch", daemon=True)
    watcher.start()
    try:
        yield True
    finally:
        if _state.active is block:
            _state.active = None
        done.set()
        watcher.join(timeout=ABANDON_POLL_S * 4)
