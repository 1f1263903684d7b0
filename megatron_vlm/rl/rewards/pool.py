"""Worker processes that run reward verifier calls, each under a time limit.

Why processes: verifiers (ours or users') are arbitrary Python on untrusted text; sympy can run for
minutes on a pathological answer and a custom function can hang, crash or call `sys.exit`. Each
call therefore runs in a worker process; the pool waits at most `timeout_s` for it. A worker that
overruns is killed and replaced (a thread could not be stopped), a worker that dies is replaced,
and an exception becomes an error result. The caller always gets one `CallResult` per call:
status "ok" with the value, or "timeout" / "error" with value 0.0 and a short reason.

Workers are started with the "spawn" method (no fork of a process that holds CUDA / NCCL state,
threads or large tensors) and import only the rewards package (no torch). Custom verifiers named
by dotted path are imported inside the worker; `sys.path` is inherited from the parent. A script
that creates a pool must guard its entry code with `if __name__ == "__main__":` (spawn re-imports
the main module).
"""
from __future__ import annotations

import importlib
import logging
import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

__all__ = ["RewardCall", "CallResult", "RewardWorkerPool", "resolve_verifier"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardCall:
    """One verifier applied to one completion."""

    verifier: str
    """A built-in verifier name ("math", "choice", "format", "exact_match") or, with
    verifier="custom", the dotted path in `function`."""
    completion: str
    answer: str
    prompt: str = ""
    metadata: Optional[dict] = None
    options: dict = field(default_factory=dict)
    function: Optional[str] = None


@dataclass(frozen=True)
class CallResult:
    value: float
    status: str  # "ok" | "timeout" | "error"
    detail: str = ""


def resolve_verifier(verifier: str, function: Optional[str] = None) -> Callable[..., Any]:
    """The callable for a built-in name, or the function at a dotted path (verifier="custom")."""
    if verifier == "custom":
        if not function or "." not in function:
            raise ValueError(f"custom reward: function must be a dotted path 'pkg.module.fn', got {function!r}")
        module_name, attr = function.rsplit(".", 1)
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"custom reward {function!r}: cannot import module {module_name!r}: {e}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"custom reward {function!r}: {attr!r} is not a callable in {module_name!r}")
        return fn
    from megatron_vlm.rl.rewards.verifiers import BUILTIN_VERIFIERS

    if verifier not in BUILTIN_VERIFIERS:
        raise ValueError(f"unknown reward verifier {verifier!r}; built-ins: {sorted(BUILTIN_VERIFIERS)}")
    return BUILTIN_VERIFIERS[verifier]


def _worker_main(conn: Connection, preload: tuple = ()) -> None:
    """Worker loop: receive (call_id, RewardCall), send (call_id, status, value, detail)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SLURM TERMs the whole step; the rank decides when to stop
    cache: dict[tuple, Callable] = {}
    # import the built-in verifiers (and sympy) before reporting ready, so that the first call's
    # time limit is not spent on imports
    import megatron_vlm.rl.rewards.verifiers  # noqa: F401

    for function in preload:  # custom verifiers; an import error is reported by the first call instead
        try:
            cache[("custom", function)] = resolve_verifier("custom", function)
        except Exception:  # noqa: BLE001
            pass
    conn.send(("ready", os.getpid(), 0.0, ""))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, call = msg
        try:
            key = (call.verifier, call.function)
            fn = cache.get(key)
            if fn is None:
                fn = cache[key] = resolve_verifier(call.verifier, call.function)
            value = float(fn(call.completion, call.answer, prompt=call.prompt, metadata=call.metadata, **call.options))
            if not math.isfinite(value):
                raise ValueError(f"verifier returned a non-finite value {value}")
            reply = (call_id, "ok", value, "")
        except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt from user code too
            reply = (call_id, "error", 0.0, f"{type(e).__name__}: {e}"[:300])
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


class _Worker:
    def __init__(self, ctx, start_timeout_s: float, preload: tuple):
        parent, child = ctx.Pipe(duplex=True)
        self.conn: Connection = parent
        self.proc = ctx.Process(target=_worker_main, args=(child, preload), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.start_deadline = time.monotonic() + start_timeout_s
        self.call_id: Optional[int] = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardWorkerPool:
    """A fixed number of reward worker processes; `map` runs calls with a per-call time limit.

    Use as a context manager or call `close()`; workers are daemons and also die with the parent."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        *,
        start_timeout_s: float = 120.0,
        start_method: str = "spawn",
        preload: Sequence[str] = (),
    ):
        """`preload`: dotted paths of custom verifiers to import at worker start-up (so a slow import
        does not count against the first call's time limit)."""
        if num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context(start_method)
        self._preload = tuple(preload)
        self._workers: list[_Worker] = []
        self.restarts = 0
        """Workers replaced so far (after a timeout or a crash)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.start_timeout_s, self._preload))

    def close(self) -> None:
        for w in self._workers:
            try:
                if w.proc.is_alive() and w.call_id is None:
                    w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._workers = []

    def __enter__(self) -> "RewardWorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        nw = _Worker(self._ctx, self.start_timeout_s, self._preload)
        self._workers[self._workers.index(w)] = nw
        return nw

    # -- running ---------------------------------------------------------------------------------
    def map(self, calls: Sequence[RewardCall]) -> list[CallResult]:
        """Run every call; returns one result per call, in order. Never raises for a verifier's
        failure; raises RuntimeError only if workers cannot start at all."""
        results: list[Optional[CallResult]] = [None] * len(calls)
        if not calls:
            return []
        self._ensure_started()
        pending = deque(range(len(calls)))
        while pending or any(w.call_id is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.call_id is None and pending:
                    cid = pending.popleft()
                    try:
                        w.conn.send((cid, calls[cid]))
                    except Exception as e:  # noqa: BLE001 - unpicklable call, or a worker that just died
                        results[cid] = CallResult(0.0, "error", f"could not send the call to a worker: {type(e).__name__}: {e}"[:300])
                        if not w.proc.is_alive():
                            self._replace(w)
                        continue
                    w.call_id, w.deadline = cid, now + self.timeout_s
            waiting = [w for w in self._workers if w.call_id is not None or not w.ready]
            deadlines = [w.deadline if w.call_id is not None else w.start_deadline for w in waiting]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            ready_conns = wait([w.conn for w in waiting], timeout=timeout)
            for conn in ready_conns:
                w = next(x for x in self._workers if x.conn is conn)
                try:
                    cid, status, value, detail = conn.recv()  # ("ready", pid, 0.0, "") at start-up
                except (EOFError, OSError):
                    w.proc.join(timeout=5)
                    code = w.proc.exitcode
                    if not w.ready:
                        self.close()
                        raise RuntimeError(
                            f"reward worker exited during start-up (exit code {code}); see its traceback above"
                        )
                    if w.call_id is not None:
                        results[w.call_id] = CallResult(0.0, "error", f"reward worker died (exit code {code})")
                    self._replace(w)
                    continue
                if cid == "ready":
                    w.ready = True
                    continue
                results[cid] = CallResult(value, status, detail)
                w.call_id = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.call_id is not None and now >= w.deadline:
                    results[w.call_id] = CallResult(0.0, "timeout", f"no result within {self.timeout_s:g}s")
                    self._replace(w)
                elif not w.ready and now >= w.start_deadline:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:g}s")
        return [r if r is not None else CallResult(0.0, "error", "lost result") for r in results]
