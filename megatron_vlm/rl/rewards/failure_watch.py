"""Stop a run that has no usable reward: `RewardFailureWatch`, fed the run's cumulative reward counters and the step's
environment episodes (both summed over ranks, so every rank takes the same decision) after each step.

Why: a verifier that raises, times out or returns NaN on every call (a bug in a custom function, a dependency missing
in the workers) scores every completion 0; an environment that fails on every call ends every trajectory as
"env_error", which is not trained. Either way the advantages, loss and gradient are 0 and a run "trains" for hours on
nothing with exit code 0. After `rl.reward_pool.max_failed_steps` steps in a row without a usable reward (every
reward call of the step failed: errors + timeouts = calls; or every environment episode of the step failed) the run
stops with exit code 1 and one line naming the key, the cause, the count and the last error (the training loop first
saves a checkpoint when steps with a reward since the newest one would be lost: `RewardsAllFailedError.streak`). A step
with one usable call and episode resets the count; a step with neither calls nor episodes neither counts nor resets it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

__all__ = ["RewardsAllFailedError", "RewardFailureWatch"]

VERIFIERS = "every reward call failed (raised, timed out or returned NaN)"
ENVIRONMENT = "every environment episode failed (env_error)"


class RewardsAllFailedError(RuntimeError):
    """No usable reward for `rl.reward_pool.max_failed_steps` steps in a row (the run exits 1)."""

    def __init__(self, message: str, streak: int = 0):
        super().__init__(message)
        self.streak = streak
        """The steps in a row without a usable reward, the one that raised included."""
        self.metrics: Optional[dict] = None
        """The metrics of the step that raised (set by the GRPO step: the loop logs them before it stops)."""


class RewardFailureWatch:
    def __init__(self, max_steps: int, key: str = "rl.reward_pool.max_failed_steps"):
        """`max_steps`: steps without a usable reward in a row that stop the run (0 = never)."""
        self.max_steps, self.key = int(max_steps), key
        self.streak = 0
        self.causes: list[str] = []
        """Why each step of the current streak had no usable reward (VERIFIERS and / or ENVIRONMENT)."""
        self._calls = self._failed = 0.0

    def update(self, totals: Mapping[str, float], step: int, last_error: str = "", *, episodes: int = 0,
               episode_errors: int = 0, env_error: str = "") -> None:
        """Take the cumulative counters after step `step` (`reward/calls`, `reward/errors`, `reward/timeouts`) and the
        step's environment episodes (`episodes` rolled out, `episode_errors` of them "env_error"); raise
        `RewardsAllFailedError` when the streak reaches the limit."""
        calls = float(totals.get("reward/calls", 0.0))
        failed = float(totals.get("reward/errors", 0.0)) + float(totals.get("reward/timeouts", 0.0))
        d_calls, d_failed = calls - self._calls, failed - self._failed
        self._calls, self._failed = calls, failed
        causes = [VERIFIERS] if d_calls > 0 and d_failed >= d_calls else []
        if episodes > 0 and episode_errors >= episodes:
            causes.append(ENVIRONMENT)
        if d_calls <= 0 and episodes <= 0:
            return
        if not causes:
            self.streak, self.causes = 0, []
            return
        self.streak += 1
        self.causes.append(" and ".join(causes))
        if self.max_steps and self.streak >= self.max_steps:
            raise RewardsAllFailedError(self._message(step, causes, last_error, env_error), self.streak)

    def _message(self, step: int, causes: list[str], last_error: str, env_error: str) -> str:
        same = all(c == self.causes[-1] for c in self.causes)
        what = self.causes[-1] if same else f"{' or '.join(causes)} (or the other, step by step)"
        errors = [e for c, e in ((VERIFIERS, last_error), (ENVIRONMENT, env_error)) if e and c in causes]
        why = f"; last error: {'; '.join(errors)}" if errors else ""
        fix = " and ".join(f for c, f in ((VERIFIERS, "the verifier (rl.rewards)"), (ENVIRONMENT, "the environment (rl.env)"))
                           if any(c in x for x in self.causes))
        return (f"{self.key}: {what} in {self.streak} steps in a row, up to step {step}: no usable reward, the run would "
                f"train on nothing{why}. Fix {fix}, or raise {self.key} (0 = never stop)")
