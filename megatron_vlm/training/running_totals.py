"""Counters that continue across a resume: `RunningTotals`.

Why: metrics such as `reward/calls`, `reward/errors`, `skipped_steps` or `data/skipped_prompts` count "so far",
but each process counts from 0, so a run resumed after a preemption logged them falling back to 0: a chart
with a saw-tooth per restart, and a failure count a user reads as the run's total that is only the last
process's. A step runner keeps one `RunningTotals`: the totals its checkpoint recorded are added to this
process's values of the same metrics (`add_to`), and the sums are saved with the next checkpoint (`state`,
under the data state's `counters`). Counters used inside the process (the reward-failure watch's window,
the step guard's consecutive count) keep their own process-local values.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

__all__ = ["CUMULATIVE_METRICS", "RunningTotals"]

CUMULATIVE_METRICS: tuple[str, ...] = (
    "reward/calls", "reward/timeouts", "reward/errors", "reward/clipped", "reward/reasoning_unclosed",
    "reward/worker_restarts", "reward/truncated",
    "data/skipped_prompts", "skipped_steps", "data/empty_steps_skipped", "data/samples_seen", "critic/skipped_updates",
)
"""The logged metrics that count since the start of the process (summed over ranks where the runner sums)."""


class RunningTotals:
    """Totals of `keys` from earlier processes of this run, added to this process's counts."""

    def __init__(self, keys: Iterable[str] = CUMULATIVE_METRICS):
        self.keys = tuple(keys)
        self.before: dict[str, float] = {}
        """The totals of the checkpoint this process resumed from."""
        self.now: dict[str, float] = {}
        """This process's latest values (as the step reported them, before the totals were added)."""

    def restore(self, data_state: Mapping[str, Any]) -> None:
        """Take the totals a checkpoint's data state recorded (none in a checkpoint written before they were)."""
        saved = data_state.get("counters") or {}
        if not isinstance(saved, Mapping):
            raise ValueError(f"data state: counters must be a table of numbers, got {type(saved).__name__}")
        self.before = {k: float(v) for k, v in saved.items() if k in self.keys}

    def add_to(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record this process's values of the counters in `metrics` and replace them by the run's totals."""
        for k in self.keys:
            if k in metrics:
                self.now[k] = float(metrics[k])
                metrics[k] = self.now[k] + self.before.get(k, 0.0)
        return metrics

    def state(self, now: Optional[Mapping[str, float]] = None) -> dict[str, dict[str, float]]:
        """`{"counters": totals}` to save with a checkpoint; `now`: this process's current values where the step
        did not report them (a step that logged nothing)."""
        if now:
            self.now.update({k: float(v) for k, v in now.items() if k in self.keys})
        names = sorted(set(self.before) | set(self.now))
        return {"counters": {k: self.before.get(k, 0.0) + self.now.get(k, 0.0) for k in names}}
