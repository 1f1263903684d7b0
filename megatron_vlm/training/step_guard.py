"""Guard of the optimizer step against non-finite numbers: `StepGuard.allow(loss, grad_norm)`.

Why: one NaN / inf loss or gradient (a bad batch, an overflow, a diverging update) written into the
weights by `optimizer.step()` poisons every later step and every checkpoint after it; nothing
recovers a run from NaN weights except an older checkpoint. So the SFT step and the GRPO update ask
the guard before each optimizer step:

- finite loss and gradient norm: take the step (the consecutive-skip counter resets);
- otherwise: skip it (the caller drops the gradients with `zero_grad`), count it (`skipped`, logged as
  `train/skipped_steps`), log a warning with both numbers;
- `max_consecutive` skipped steps in a row (`train.max_consecutive_skipped_steps`, 0 = never stop)
  raise `NonFiniteStepError`: the run stops with an error, and since no skipped step changed the
  weights, no checkpoint ever holds NaN weights.

The decision is the same on every rank: the gradient norm is already global (`clip_grad_norm_`
reduces it over shards) and a non-finite local loss is shared with one all-reduce, so no rank steps
while another skips (FSDP would deadlock or diverge).
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from megatron_vlm.parallel.collectives import any_rank

__all__ = ["StepGuard", "NonFiniteStepError", "DEFAULT_MAX_CONSECUTIVE_SKIPPED"]

log = logging.getLogger("megatron_vlm")

DEFAULT_MAX_CONSECUTIVE_SKIPPED = 5
"""Used when a config has no `train.max_consecutive_skipped_steps` (light test stand-ins)."""


class NonFiniteStepError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class StepGuard:
    """Counts skipped optimizer steps; `max_consecutive` in a row (0 = no limit) raise."""

    def __init__(self, max_consecutive: int, device: torch.device, *, what: str = "optimizer step"):
        self.max_consecutive = int(max_consecutive)
        self.device = device
        self.what = what
        self.skipped = 0
        """Optimizer steps skipped so far in this process (the `train/skipped_steps` metric)."""
        self.consecutive = 0

    @classmethod
    def from_config(cls, train_cfg: Any, device: torch.device, **kw: Any) -> StepGuard:
        return cls(getattr(train_cfg, "max_consecutive_skipped_steps", DEFAULT_MAX_CONSECUTIVE_SKIPPED), device, **kw)

    def allow(self, loss: float, grad_norm: float | torch.Tensor, *, step: int, loss_is_global: bool = False) -> bool:
        """True when the optimizer step may run. Collective: every rank calls it at the same point.
        `loss`: this rank's loss (any float), or with `loss_is_global` a value every rank holds alike (the sum over
        the ranks: no collective then); `grad_norm`: the global norm (tensor or float);
        `step`: the 1-based step number, for the messages."""
        norm = float(grad_norm)
        finite = math.isfinite(float(loss))
        bad = (not finite if loss_is_global else any_rank(not finite, self.device)) or not math.isfinite(norm)
        if not bad:
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        log.warning("step %d: non-finite loss or gradient norm (loss %s %s, grad norm %s): %s skipped "
                    "(%d skipped so far, %d in a row)", step, loss, "over all ranks" if loss_is_global else "on this rank",
                    norm, self.what, self.skipped, self.consecutive)
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteStepError(
                f"{self.consecutive} optimizer steps in a row had a non-finite loss or gradient norm (last at step "
                f"{step}); stopping before the weights are damaged (train.max_consecutive_skipped_steps = "
                f"{self.max_consecutive}). Lower optimizer.lr, check the data, or resume from the last checkpoint")
        return False
