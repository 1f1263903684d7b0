#!/usr/bin/env python
"""Test-only entry point: launch/pretrain_vlm.py with a fault-injection hook in the training loop.

`MEGATRON_VLM_FAULT_KILL_AT_STEP=N` SIGKILLs the process just before training step N (1-based)
runs, to prove that a resume never needs a clean exit. The variable is read here, not by the
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
REPO = Path(__file__).resolve().parents[2]


def kill_before(step_to_kill: int):
    def before_step(step: int) -> None:
        if step == step_to_kill:
            os.kill(os.getpid(), signal.SIGKILL)
    return before_step


def _entry_main():
    spec = importlib.util.spec_from_file_location("pretrain_vlm_entry", REPO / "launch" / "pretrain_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


if __name__ == "__main__":
    kill_at = os.environ.get(FAULT_KILL_ENV)
    hook = kill_before(int(kill_at)) if kill_at else None
    from megatron_vlm.runner import exit_process

    exit_process(_entry_main()(before_step=hook))
