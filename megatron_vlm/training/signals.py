"""Graceful stop on SIGTERM (SLURM preemption / time limit) and SIGUSR1 (SLURM's --signal warning):
the job saves a checkpoint at the next step boundary and exits 143. Ctrl-C (SIGINT) is not caught
here: it interrupts at once (no checkpoint; the runner tears down the process groups, exit 130), so
an interactive user is never kept waiting for a step to finish.

The handler only sets a flag; the loop checks it at a step boundary, and ranks agree through an
all-reduce (MAX) so every rank saves the same checkpoint step — a rank that stopped alone would
leave the others blocked in a collective. The packed-data steps (SFT, DPO, reward model) agree in the all-reduce
of their token counts instead, which every step makes before its forward anyway: a stop asked during step N is
agreed at the start of step N + 1, which puts back the packs it fetched and raises `StopAgreed` before any of it
runs; the loop then saves step N and exits 143 as at the boundary (on CUDA each read of the agreement is a stream
sync: one fewer per step). The boundary check stays where the loop needs the answer before the next step would
start: before a periodic evaluation and after the last step.

A wait inside a step that can hang for minutes (a reward batch, the environments of a multi-turn rollout: up to
`rl.reward_pool.batch_timeout_s`, longer than the scheduler's warning) polls the flag and gives up once it has waited
a moment with a stop pending (abandon.py `ABANDON_GRACE_S`): the step is abandoned (`StepAbandoned`, agreed by
every rank), and the loop saves the state of the step's start and exits 143, as at a step boundary. Long work of a
step that runs in the rank asks the flag the same way: the built-in engine's generation between decode steps, the vLLM
engine's between engine steps, a model reward between its forwards (inference/policy_engine.py, inference/vllm_engine.py,
rl/rewards/model_reward.py). One call that does not return (a kernel, a collective, one vLLM engine step) is acted on
only when it returns. A held-out
evaluation of a training run (GRPO's accuracy with the verifiers) gives up the same way (`EvaluationAbandoned`): its
metrics are not logged, and the loop saves the step it followed and exits 143.

A job with no step boundary to stop at (an evaluation, `train.mode = "eval"`) runs its work inside
`interrupting()`: there a stop signal raises `StopRequested` at once (as Ctrl-C raises KeyboardInterrupt), so the
job ends with 143 and one line instead of ignoring the signal until the scheduler's SIGKILL.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megatron_vlm.parallel.collectives import to_device
from megatron_vlm.stop_signals import STOP_SIGNALS


class StopRequested(BaseException):
    """A stop signal inside `StopFlag.interrupting()`; a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StepAbandoned(Exception):
    """Every rank gave up the step it was running because a stop is pending and a wait of the step hung (the
    training loop then saves the state of the step's start and exits 143). Raised by every rank at the same point
    (after an agreement), so that none waits in a collective the others skip."""


class StopAgreed(Exception):
    """Every rank agreed, at the start of a step and before any of it ran, on a stop asked before it (the stop flags
    travel in the step's first all-reduce: training/sft.py `agree_counts`); the step has put back the packs it
    fetched, and the loop stops at the boundary before it (its checkpoint, exit 143), as after a step."""


class EvaluationAbandoned(Exception):
    """Every rank gave up a held-out evaluation of a training run because a stop is pending and a wait of it hung
    (the evaluation's verifiers or environments): nothing of it is logged, and the loop stops as at a step boundary
    (training/loop.py). Raised by every rank at the same point, after an agreement (rl/give_up.py)."""


class StopFlag:
    def __init__(self):
        self.signum = 0
        self._prev = {}
        self._interrupt = False

    def install(self) -> StopFlag:
        for s in STOP_SIGNALS:
            self._prev[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.signum = signum
        if self._interrupt:
            self._interrupt = False  # raised once: the unwinding (closing workers) is not interrupted again
            raise StopRequested(signum)

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Inside: a stop signal (or one received before entering) raises `StopRequested`."""
        if self.signum:
            raise StopRequested(self.signum)
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def pending(self) -> bool:
        """A stop signal arrived (this process's, or another rank's reported to it): the check a wait polls."""
        return bool(self.signum)

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank received a stop signal (collective). A single process reads its own flag: a device
        tensor there would be an upload and a read back per step, each a stream sync on CUDA."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return bool(self.signum)
        flag = to_device([1 if self.signum else 0], torch.int64, device)  # (no wait for the device: the read does)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._prev.items():
            signal.signal(s, h)
