"""Stop a run whose reward calls all fail: `RewardFailureWatch`, fed the run's cumulative reward counters
(summed over ranks, so every rank takes the same decision) after each step.

Why: a verifier that raises on every call (a bug in a custom function, a dependency missing in the workers)
or times out on every call scores every completion 0. The advantages are then all 0, the loss and gradient
are 0, and a run "trains" for hours on nothing with exit code 0. After `rl.reward_pool.max_failed_steps` steps in a
row in which every reward call failed (errors + timeouts = calls), the run stops with exit code 1 and one line
naming the key and the last error. A step with no reward calls neither counts nor resets the streak.
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RewardsAllFailedError", "RewardFailureWatch"]


class RewardsAllFailedError(RuntimeError):
    """Every reward call failed for `rl.reward_pool.max_failed_steps` steps in a row (the run exits 1)."""


class RewardFailureWatch:
    def __init__(self, max_steps: int, key: str = "rl.reward_pool.max_failed_steps"):
        """`max_steps`: failed steps in a row that stop the run (0 = never)."""
        self.max_steps, self.key = int(max_steps), key
        self.streak = 0
        self._calls = self._failed = 0.0

    def update(self, totals: Mapping[str, float], step: int, last_error: str = "") -> None:
        """Take the cumulative counters after step `step` (`reward/calls`, `reward/errors`, `reward/timeouts`);
        raise `RewardsAllFailedError` when the streak reaches the limit."""
        calls = float(totals.get("reward/calls", 0.0))
        failed = float(totals.get("reward/errors", 0.0)) + float(totals.get("reward/timeouts", 0.0))
        d_calls, d_failed = calls - self._calls, failed - self._failed
        self._calls, self._failed = calls, failed
        if d_calls <= 0:
            return
        self.streak = self.streak + 1 if d_failed >= d_calls else 0
        if self.max_steps and self.streak >= self.max_steps:
            why = f"; last error: {last_error}" if last_error else ""
            raise RewardsAllFailedError(
                f"{self.key}: every reward call failed (raised or timed out) in {self.streak} steps in a row, up to "
                f"step {step}: the rewards are all 0 and the run would train on nothing{why}. Fix the verifier "
                f"(rl.rewards), or raise {self.key} (0 = never stop)")
