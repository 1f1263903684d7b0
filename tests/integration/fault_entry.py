#!/usr/bin/env python
"""Test-only entry point: launch/pretrain_vlm.py with a fault-injection hook in the training loop.

`MEGATRON_VLM_FAULT_KILL_AT_STEP=N` SIGKILLs the process just before training step N (1-based)
runs, to prove that a resume never needs a clean exit; `MEGATRON_VLM_FAULT_RAISE_AT_STEP=N` raises an
unexpected exception there instead (a bug, a peer's dropped connection), to prove that a crash ends the process;
`MEGATRON_VLM_FAULT_TERM_AT_STEP=N` sends the process SIGTERM there (a scheduler's stop between two steps). The variable is read here, not by the
package: production code has no fault-injection path; the loop only calls the `before_step` hook
this script gives it. tests/integration/jobs.py runs this script instead of the real entry point
when a test sets the variable (also under torchrun: every rank installs the hook).
"""
from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

FAULT_KILL_ENV = "MEGATRON_VLM_FAULT_KILL_AT_STEP"
FAULT_RAISE_ENV = "MEGATRON_VLM_FAULT_RAISE_AT_STEP"
FAULT_TERM_ENV = "MEGATRON_VLM_FAULT_TERM_AT_STEP"
REPO = Path(__file__).resolve().parents[2]


def kill_before(step_to_kill: int):
    def before_step(step: int) -> None:
        if step == step_to_kill:
            os.kill(os.getpid(), signal.SIGKILL)
    return before_step


def raise_before(step_to_fail: int):
    def before_step(step: int) -> None:
        if step == step_to_fail:
            raise RuntimeError(f"fault injected before step {step}")
    return before_step


def term_before(step_to_stop: int):
    def before_step(step: int) -> None:
        if step == step_to_stop:
            os.kill(os.getpid(), signal.SIGTERM)
    return before_step


def _entry_main():
    spec = importlib.util.spec_from_file_location("pretrain_vlm_entry", REPO / "launch" / "pretrain_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


if __name__ == "__main__":
    kill_at, raise_at, term_at = (os.environ.get(k) for k in (FAULT_KILL_ENV, FAULT_RAISE_ENV, FAULT_TERM_ENV))
    hook = (kill_before(int(kill_at)) if kill_at else raise_before(int(raise_at)) if raise_at
            else term_before(int(term_at)) if term_at else None)
    from megatron_vlm.runner import run_entry

    main = _entry_main()
    run_entry(lambda: main(before_step=hook))
