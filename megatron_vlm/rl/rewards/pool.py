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

Limits, so that a verifier cannot take the run down with it:

- memory: each worker caps its own address space (`RLIMIT_AS`, `memory_limit_mb`, 0 = no cap) before
  importing anything, so a verifier that allocates without bound gets a MemoryError (an error
  result) or dies (replaced) instead of driving the node into the OOM killer, which may pick a
  training rank. The cap covers the interpreter and sympy too (a few hundred MiB of address space);
- parent death: a worker dies with the process that started it (Linux `PR_SET_PDEATHSIG` = SIGKILL,
  plus a watchdog thread that exits when the parent pid changes), so a rank killed with SIGKILL
  (OOM killer, `scancel`, a crashed node agent) leaves no worker behind busy in a hung verifier;
- batch deadline: `map` returns within `batch_timeout_s` of its first call however many calls time
  out one after the other (a per-call limit alone allows N x timeout_s); calls still running at the
  deadline score "timeout" (their workers are replaced), calls not started score "timeout" too;
- values: a finite value within +-`value_limit` is returned as is; +-inf and larger values (an int like
  10**400 included) are clipped to +-`value_limit`, with status "clipped" (counted by the manager, the value
  used), so one custom verifier returning 1e30 cannot swamp the advantages of its group or overflow the loss.
  NaN is no value at all: an error result (0, counted as a failed call, as the model rewards' NaN is), so a
  verifier that returns NaN on every call stops the run like one that raises (failure_watch.py). A value that
  is not a number (the string "0.75", None) is an error result, never parsed;
- children: each worker runs in its own session / process group, and a worker that is killed (deadline,
  replacement, close) is killed with its whole group, so subprocesses a hung verifier started (which
  inherit the worker's ignored stop signals) do not outlive it;
- an exception whose `__str__` raises is reported as such (an error result); it does not kill the worker;
- stopping: `map(calls, abandon=check)` asks `check()` at least every `ABANDON_POLL_S` seconds while it waits; once
  it has answered True (the rank is stopping: training/signals.py `StopFlag.pending`) for `ABANDON_GRACE_S` of this
  wait, the calls in flight are killed with their workers and `WaitAbandoned` is raised, so a hung batch does not
  hold a stopping job for `batch_timeout_s`, while a batch about to end still ends (its step is not thrown away).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from megatron_vlm.abandon import ABANDON_POLL_S, Patience, WaitAbandoned
from megatron_vlm.stop_signals import leave_stop_signals_to_the_rank

__all__ = ["RewardCall", "CallResult", "RewardWorkerPool", "WaitAbandoned", "resolve_verifier"]

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
    status: str  # "ok" | "timeout" | "error" (NaN included) | "clipped" (value replaced: infinite or beyond the limit)
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


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies: the kernel's parent-death signal where there is one
    (Linux; it fires when the thread that started the worker exits, so pools are started from the
    thread that uses them), and a watchdog thread that notices a changed parent pid (re-parenting)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _limit_memory(limit_mb: int) -> str:
    """Cap this process's address space; returns why the cap does not hold ("" when it does, or when there is none).

    Why the check: a platform may accept RLIMIT_AS and not enforce it (macOS), and then `memory_limit_mb` would do
    nothing. An anonymous mapping past the cap, never touched (address space only, no memory), must fail."""
    if limit_mb <= 0:
        return ""
    try:
        import resource

        cap = int(limit_mb) * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, AttributeError, ValueError, OSError) as e:
        return f"the address-space cap (RLIMIT_AS) cannot be set on {sys.platform}: {_describe(e)}"
    import mmap

    try:
        probe = mmap.mmap(-1, cap + 2**20)
    except (OSError, ValueError, OverflowError, MemoryError):
        return ""
    probe.close()
    return f"the address-space cap (RLIMIT_AS) is not enforced on {sys.platform} (a mapping past it succeeded)"


def _describe(e: BaseException) -> str:
    """"Type: message" of an exception, even one whose `__str__` raises (a verifier's own exception class)."""
    try:
        text = str(e)
    except BaseException:  # noqa: BLE001 - any failure of user code, SystemExit included
        text = "<the exception's message could not be printed>"
    try:
        name = type(e).__name__
    except BaseException:  # noqa: BLE001
        name = "Exception"
    return f"{name}: {text}"[:300]


def _number(value: Any) -> float:
    """A verifier's value as a float: numbers only (bool, int, float, numpy / torch scalars). An int too large for
    a float becomes +-inf (clipped to +-value_limit afterwards, as the docs promise, not an OverflowError); a
    string such as "0.75", None or any other object is refused (TypeError: an error result)."""
    if isinstance(value, (str, bytes, bytearray)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise TypeError(f"the verifier returned {type(value).__name__} {value!r:.60}, not a number")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _signature(fn: Callable) -> Optional[list]:
    """[[name, kind, has_default], ...] of `fn`'s parameters (None when it cannot be inspected), so the parent
    can check how it will be called without importing the user's module itself."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [[p.name, int(p.kind), p.default is not inspect.Parameter.empty] for p in sig.parameters.values()]


def isolate_worker(memory_limit_mb: int, parent_pid: int) -> str:
    """The limits every pool worker sets on itself first (module docstring): own session, death with the parent,
    address-space cap, signals left to the parent. Also the environment pool's workers (rl/env/pool.py). Returns why
    the memory cap does not hold ("" when it does): the worker reports it as "memory" with "ready" (`start`)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setsid()  # its own session and process group: the pool kills the group, so a verifier's children die too
    if parent_pid:
        _die_with_parent(parent_pid)
    memory = _limit_memory(memory_limit_mb)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    leave_stop_signals_to_the_rank()  # SLURM signals the whole step (TERM / USR1); the rank decides when to stop
    return memory


def serve_calls(conn: Connection, run: Callable[[Any], Any]) -> None:
    """Receive (call_id, call) until the pipe closes or None arrives; send (call_id, "ok", run(call), "") or
    (call_id, "error", 0.0, why) — an exception of user code (SystemExit included) never ends the worker."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, call = msg
        reply: tuple[Any, str, Any, str]
        try:
            reply = (call_id, "ok", run(call), "")
        except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt from user code too
            reply = (call_id, "error", 0.0, _describe(e))
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


def _worker_main(conn: Connection, preload: tuple = (), memory_limit_mb: int = 0, parent_pid: int = 0) -> None:
    """Worker loop: receive (call_id, RewardCall), send (call_id, status, value, detail)."""
    memory = isolate_worker(memory_limit_mb, parent_pid)
    cache: dict[tuple, Callable] = {}
    # import the built-in verifiers (and sympy) before reporting ready, so that the first call's
    # time limit is not spent on imports
    import megatron_vlm.rl.rewards.verifiers  # noqa: F401

    failed: dict[str, str] = {}
    params: dict[str, Optional[list]] = {}
    for function in preload:  # custom verifiers; a failure goes back with "ready" (`start`) and to every call
        try:
            cache[("custom", function)] = preloaded = resolve_verifier("custom", function)
            params[function] = _signature(preloaded)
        except BaseException as e:  # noqa: BLE001 - sys.exit at import too
            failed[function] = (str(e) if type(e) is ValueError else _describe(e))[:300]
    conn.send(("ready", os.getpid(), 0.0, json.dumps({"failed": failed, "params": params, "memory": memory})))

    def run(call: RewardCall) -> float:
        key = (call.verifier, call.function)
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = resolve_verifier(call.verifier, call.function)
        return _number(fn(call.completion, call.answer, prompt=call.prompt, metadata=call.metadata, **call.options))

    serve_calls(conn, run)


class _Worker:
    def __init__(self, ctx, start_timeout_s: float, preload: tuple, memory_limit_mb: int = 0,
                 target: Callable = _worker_main):
        parent, child = ctx.Pipe(duplex=True)
        self.conn: Connection = parent
        self.proc = ctx.Process(target=target, args=(child, preload, memory_limit_mb, os.getpid()), daemon=True,
                                name="reward-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.start_deadline = time.monotonic() + start_timeout_s
        self.call_id: Optional[int] = None
        self.deadline = 0.0

    def kill(self) -> None:
        """Kill the worker and everything its verifier started (its process group: the worker's own session),
        so a verifier that spawned a hanging subprocess leaves nothing behind."""
        if self.proc.pid is not None and hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardWorkerPool:
    """A fixed number of reward worker processes; `map` runs calls with a per-call time limit.

    Use as a context manager or call `close()`; workers are daemons and also die with the parent.
    `worker_main`: the workers' loop (the environment pool, rl/env/pool.py, runs its own with these limits)."""

    worker_main: Callable = staticmethod(_worker_main)
    waits_for = "verifiers"
    """What its calls run (`WaitAbandoned.waited_for`)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        *,
        start_timeout_s: float = 120.0,
        start_method: str = "spawn",
        preload: Sequence[str] = (),
        memory_limit_mb: int = 0,
        batch_timeout_s: Optional[float] = None,
        value_limit: Optional[float] = None,
    ):
        """`preload`: dotted paths of custom verifiers to import at worker start-up (so a slow import
        does not count against the first call's time limit); `memory_limit_mb`: each worker's address
        space cap (0 = none); `batch_timeout_s`: the deadline of one `map` from its first call (None =
        none); `value_limit`: values beyond +-this are clipped to it (None = no bound: only infinite values are
        replaced, by 0); NaN is an error result whatever the limit."""
        if num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if batch_timeout_s is not None and batch_timeout_s <= 0:
            raise ValueError(f"batch_timeout_s: must be > 0, got {batch_timeout_s}")
        if value_limit is not None and not (value_limit > 0 and math.isfinite(value_limit)):
            raise ValueError(f"value_limit: must be finite and > 0, got {value_limit}")
        if memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb: must be >= 0, got {memory_limit_mb}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self.batch_timeout_s = batch_timeout_s
        self.value_limit = value_limit
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context(start_method)
        self._preload = tuple(preload)
        self._workers: list[_Worker] = []
        self.signatures: dict[str, Optional[list]] = {}
        """The parameters of each `preload` function ([[name, kind, has_default], ...]; None: not inspectable),
        known after `start`."""
        self.restarts = 0
        """Workers replaced so far (after a timeout or a crash)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.start_timeout_s, self._preload, self.memory_limit_mb,
                                         self.worker_main))

    def close(self) -> None:
        """Idle workers are asked to exit (2 s in all), then every worker is killed with its process group. A worker
        with a call in flight is killed at once: it was not asked and would not answer (a hung verifier), and waiting
        for it per worker held a stopping job (an evaluation job's SIGTERM) 2 s for each."""
        asked = []
        for w in self._workers:
            try:
                if w.proc.is_alive() and w.call_id is None:
                    w.conn.send(None)
                    asked.append(w)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in asked:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self) -> RewardWorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        nw = _Worker(self._ctx, self.start_timeout_s, self._preload, self.memory_limit_mb, self.worker_main)
        self._workers[self._workers.index(w)] = nw
        return nw

    def start(self) -> dict[str, str]:
        """Start the workers now and wait until each is ready; returns {dotted path: error} for the
        `preload` functions a worker could not import (empty when all resolve), so a caller can refuse
        a misspelt custom verifier before the first step instead of scoring every call 0. RuntimeError
        when a worker does not start; ConfigError naming rl.reward_pool.memory_limit_mb when a worker cannot
        enforce its memory cap (the key would silently do nothing)."""
        self._ensure_started()
        failed: dict[str, str] = {}
        for w in self._workers:
            while not w.ready:
                left = w.start_deadline - time.monotonic()
                if left <= 0 or not w.conn.poll(left):
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:g} s")
                try:
                    cid, _, _, detail = w.conn.recv()
                except (EOFError, OSError) as err:
                    w.proc.join(timeout=5)
                    code = w.proc.exitcode
                    self.close()
                    raise RuntimeError(
                        f"reward worker exited during start-up (exit code {code}); see its traceback above"
                    ) from err
                if cid == "ready":
                    w.ready = True
                    report = json.loads(detail) if detail else {}
                    if report.get("memory"):
                        self.close()
                        from megatron_vlm.errors import ConfigError

                        raise ConfigError(f"rl.reward_pool.memory_limit_mb: {self.memory_limit_mb} cannot be "
                                          f"enforced here: {report['memory']}; set 0 (no cap) on this platform")
                    failed.update(report.get("failed", {}))
                    self.signatures.update(report.get("params", {}))
        return failed

    # -- running ---------------------------------------------------------------------------------
    def _checked(self, value: float, status: str, detail: str) -> CallResult:
        """Clip a verifier's value: beyond +-value_limit (inf included) -> +-value_limit; NaN -> an error (0)."""
        if status != "ok":
            return CallResult(value, status, detail)
        if math.isnan(value):
            return CallResult(0.0, "error", "the verifier returned NaN (not a number): scored 0")
        limit = self.value_limit
        if math.isfinite(value) and (limit is None or abs(value) <= limit):
            return CallResult(value, "ok", detail)
        if limit is None:
            clipped = 0.0
        else:
            clipped = math.copysign(limit, value)
        return CallResult(clipped, "clipped", f"verifier returned {value!r}; clipped to {clipped:g}")

    def map(self, calls: Sequence[RewardCall], *,
            abandon: Optional[Callable[[], bool]] = None) -> list[CallResult]:
        """Run every call; returns one result per call, in order. Never raises for a verifier's
        failure; raises RuntimeError only if workers cannot start at all. Returns within
        `batch_timeout_s` of the first call sent (when set). `abandon`: asked while waiting (module
        docstring); True for `ABANDON_GRACE_S` raises `WaitAbandoned` (within `ABANDON_POLL_S` more)."""
        results: list[Optional[CallResult]] = [None] * len(calls)
        if not calls:
            return []
        self._ensure_started()
        pending = deque(range(len(calls)))
        give_up = Patience(abandon) if abandon is not None else None
        batch_deadline = float("inf")  # set when the first call is sent (worker start-up has its own limit)
        while pending or any(w.call_id is not None for w in self._workers):
            if give_up is not None and give_up():
                self._abandon()
                raise WaitAbandoned.of(len(calls), self.waits_for)
            now = time.monotonic()
            if now >= batch_deadline:
                self._expire(results, pending)
                break
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
                    if self.batch_timeout_s is not None and batch_deadline == float("inf"):
                        batch_deadline = now + self.batch_timeout_s
            waiting = [w for w in self._workers if w.call_id is not None or not w.ready]
            deadlines = [w.deadline if w.call_id is not None else w.start_deadline for w in waiting]
            timeout = max(0.0, min([*deadlines, batch_deadline]) - time.monotonic()) if deadlines else 0.0
            if abandon is not None:
                timeout = min(timeout, ABANDON_POLL_S)
            ready_conns = wait([w.conn for w in waiting], timeout=timeout)
            for conn in ready_conns:
                w = next(x for x in self._workers if x.conn is conn)
                try:
                    cid, status, value, detail = w.conn.recv()  # ("ready", pid, 0.0, "") at start-up; w.conn is conn
                except (EOFError, OSError) as err:
                    w.proc.join(timeout=5)
                    code = w.proc.exitcode
                    if not w.ready:
                        self.close()
                        raise RuntimeError(
                            f"reward worker exited during start-up (exit code {code}); see its traceback above"
                        ) from err
                    if w.call_id is not None:
                        results[w.call_id] = CallResult(0.0, "error", f"reward worker died (exit code {code})")
                    self._replace(w)
                    continue
                if cid == "ready":
                    w.ready = True
                    continue
                results[cid] = self._checked(value, status, detail)
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

    def _abandon(self) -> None:
        """Kill the workers with a call in flight (their results would answer a batch nobody waits for); the
        next `map` starts new ones. Not counted as restarts: nothing failed."""
        busy = [w for w in self._workers if w.call_id is not None]
        for w in busy:
            w.kill()
        self._workers = [w for w in self._workers if w not in busy]

    def _expire(self, results: list, pending: deque) -> None:
        """The batch deadline passed: running calls and calls never sent score "timeout"."""
        detail = f"batch deadline: no result within {self.batch_timeout_s:g}s for the whole batch"
        for w in list(self._workers):
            if w.call_id is not None:
                results[w.call_id] = CallResult(0.0, "timeout", detail)
                self._replace(w)
        while pending:
            results[pending.popleft()] = CallResult(0.0, "timeout", detail + " (not started)")
