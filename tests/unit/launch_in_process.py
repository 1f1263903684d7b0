"""A launch/ entry point's `main` run inside the test process, read back as `subprocess.run` would give it.

Why: a config refusal or a `--check` through a fresh interpreter spends seconds importing torch and the
package before the one line the test reads; the test process has them imported already. Tests whose subject
is the process itself (its real exit status, what a real interpreter prints on stderr, signals) keep running
the script as a process; this runner is for what `main` decides: the exit code, stdout and stderr.

The runner is for refusals and `--check` only: a command line that would start a job (run_job) is a failure
here, not a job run inside the test process.
"""
from __future__ import annotations

import contextlib
import io
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from tests.unit.launch_scripts import import_launch_script

REPO = Path(__file__).resolve().parents[2]


@dataclass
class LaunchResult:
    """What `subprocess.run(..., capture_output=True, text=True)` gives: the exit code and both streams."""

    returncode: int
    stdout: str
    stderr: str


def _exit_code(e: SystemExit, err: io.StringIO) -> int:
    """The process exit status of an uncaught SystemExit, as the interpreter sets it (a message: printed, 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=err)
    return 1


def capture_main(main: Callable[[list[str]], Optional[int]], argv: list[str], *, cwd: Optional[Path] = REPO,
                 crash_exits_1: bool = False, err: Optional[io.StringIO] = None) -> LaunchResult:
    """`main(argv)` in `cwd` (the repository root by default; None: where the test is), its stdout and stderr
    captured and its exit read as the process's: the return value, a SystemExit's status. Another exception
    propagates, or with `crash_exits_1` ends as a process would: the traceback on stderr, status 1 (a whole job
    run here, whose crash is what the test looks at). `err`: the buffer for stderr (one that a log handler writes
    into too, so that both come back in the order written). The working folder is put back."""
    out, err = io.StringIO(), err if err is not None else io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = _exit_code(e, err)
            except Exception:  # noqa: BLE001 - a crash, reported as the process would report it
                if not crash_exits_1:
                    raise
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
    return LaunchResult(0 if code is None else code, out.getvalue(), err.getvalue())


def _no_job(cfg, **kwargs):
    raise AssertionError(f"the launcher would start a {cfg.train.mode!r} job: the config was not refused")


def run_launcher(script: str, argv: list[Union[str, Path]], cwd: Optional[Path] = REPO) -> LaunchResult:
    """`python launch/<script>.py *argv` (in `cwd`, the repository root by default), run in this process.

    Every exit the script's `main` takes is read as the process's: its return value, a SystemExit (config
    errors, argparse's usage errors). Any other exception propagates (a real process would end with 1 and a
    traceback); so does the AssertionError of a command line that would start a job."""
    pretrain = import_launch_script("pretrain_vlm")  # launch/evaluate.py runs pretrain_vlm's main: one stub for both
    module = import_launch_script(script)
    real_run_job = pretrain.run_job
    pretrain.run_job = _no_job
    try:
        return capture_main(module.main, [str(a) for a in argv], cwd=cwd)
    finally:
        pretrain.run_job = real_run_job
