"""The signals that ask a run to stop with a checkpoint, and the rule that a rank's helper processes leave
them to the rank.

Why the rule: SLURM delivers a stop request (`scancel --signal=TERM|USR1`, `--signal=USR1@<s>`, preemption) to
every process of the job step, the helpers a rank started included: data-loader workers, the length pass's
workers, reward and environment workers. TERM and USR1 end a process by default, and a helper ended that way
hurts its rank before the rank can save (a DataLoader raises on its dead worker wherever the rank is, the
checkpoint save included; a reward worker's call fails). The rank stops at the next step boundary, agreed with
the other ranks (training/signals.py), and ends its helpers itself.

Only the standard library: reward workers import this without torch.
"""
from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "leave_stop_signals_to_the_rank"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""TERM: SLURM's preemption / time-limit signal (the batch script forwards it), torchrun's shutdown signal;
USR1: SLURM's `--signal` warning of choice. The rank saves a checkpoint and exits 143 on either."""


def leave_stop_signals_to_the_rank(*, term: bool = True) -> None:
    """Ignore the stop signals in this helper process (call it first thing in the helper); `term=False` keeps
    TERM's default for a pool whose owner ends its workers with TERM (the length pass, data/lengths.py)."""
    for s in STOP_SIGNALS:
        if term or s != signal.SIGTERM:
            signal.signal(s, signal.SIG_IGN)
