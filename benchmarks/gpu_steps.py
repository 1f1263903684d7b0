"""Steps of the GPU suite and how they run: one at a time, or several at once, each under its own time limit.

Why a module of its own: a GPU lease (15 minutes of device time) cannot afford to run the correctness
checks one after another, so steps that share a `group` in a section run concurrently (the GPU and the
CPU cores have room for them); benchmarks keep an empty group and run alone, because their timings
must not share the device. A step past its limit is ended with its whole process group (pytest-xdist
workers, cmake / nvcc children), not only the direct child, so nothing it started keeps the GPU busy
while the next step is timed.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    json_out: str = ""
    """File name (in the run folder) the step's --json output goes to."""
    env: dict = field(default_factory=dict)
    """Extra environment: a None value removes the variable; PYTHONPATH is put in front of the inherited one."""
    group: str = ""
    """Consecutive steps of a section with the same non-empty group run concurrently."""
    note: str = ""
    """Shown by the dry run (e.g. the shapes a lease-sized benchmark measures)."""


@dataclass
class Section:
    name: str
    steps: list[Step]


def batches(steps: list[Step]) -> list[list[Step]]:
    """Steps in run order: consecutive steps of one non-empty group together, every other step alone."""
    out: list[list[Step]] = []
    for st in steps:
        if st.group and out and out[-1][0].group == st.group:
            out[-1].append(st)
        else:
            out.append([st])
    return out


def batch_limit_s(steps: list[Step]) -> int:
    """Wall-clock bound of a section: its batches one after another, each as long as its longest step."""
    return sum(max(st.timeout_s for st in b) for b in batches(steps))


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def child_env(extra: dict) -> dict:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    front = [p for p in extra.get("PYTHONPATH", "").split(os.pathsep) if p] if extra.get("PYTHONPATH") else []
    for k, v in extra.items():
        if k == "PYTHONPATH":
            continue
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    ordered = []
    for p in front + [str(ROOT)] + paths:  # the repository is always importable (it is not pip-installed on the GPU image)
        if p not in ordered:
            ordered.append(p)
    env["PYTHONPATH"] = os.pathsep.join(ordered)
    return env


_LIVE: dict[int, subprocess.Popen] = {}
"""Steps running now (pid -> process), for end_all."""


def end_all() -> None:
    """End every running step's process group (the suite itself is being stopped: its steps must not outlive it,
    since each runs in a session of its own and would keep the GPU busy)."""
    for proc in list(_LIVE.values()):
        _end_group(proc)
    _LIVE.clear()


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_batch(steps: list[Step], logs: dict[str, Path], on_done: Optional[Callable[[Step, int, float], None]] = None,
              poll_s: float = 0.2) -> dict[str, tuple[int, float]]:
    """Start every step of the batch at once, each writing to logs[step.name] (appended); end each at its limit
    (exit code 124; 127 when the program is missing). Returns {name: (exit code, seconds)}; `on_done` is
    called as each step finishes, in the order they finish."""
    running = {}
    results: dict[str, tuple[int, float]] = {}
    for st in steps:
        log = open(logs[st.name], "a")  # noqa: SIM115 -- stays open while the step runs; closed when it ends
        log.write(f"\n$ {shlex.join(st.argv)}\n")
        log.flush()
        t0 = time.time()
        try:
            proc = subprocess.Popen(st.argv, cwd=ROOT, env=child_env(st.env), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except (FileNotFoundError, PermissionError) as exc:
            log.write(f"\n[gpu_suite] {st.name}: {exc}\n[gpu_suite] {st.name}: exit 127 after 0 s\n")
            log.close()
            results[st.name] = (127, 0.0)
            if on_done:
                on_done(st, 127, 0.0)
            continue
        running[st.name] = (st, proc, log, t0)
        _LIVE[proc.pid] = proc
    while running:
        time.sleep(poll_s)
        for name in list(running):
            st, proc, log, t0 = running[name]
            code = proc.poll()
            elapsed = time.time() - t0
            if code is None and elapsed > st.timeout_s:
                _end_group(proc)
                log.write(f"\n[gpu_suite] {st.name}: time limit {st.timeout_s} s reached\n")
                code = 124
            if code is None:
                continue
            if code != 124:
                _end_group(proc)  # whatever the step left running in its group (a background server, a worker)
            _LIVE.pop(proc.pid, None)
            log.write(f"[gpu_suite] {st.name}: exit {code} after {elapsed:.0f} s\n")
            log.close()
            del running[name]
            results[name] = (code, elapsed)
            if on_done:
                on_done(st, code, elapsed)
    return results
