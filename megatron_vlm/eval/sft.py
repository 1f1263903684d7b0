"""The evaluation of an SFT run at a step: held-out loss / perplexity and, with `train.eval_generate`,
greedy answer accuracy — `SFTEvaluator(ctx, bundle, bad_records)(step) -> metrics`.

`prepare()` opens the eval split before the first training step: an eval split none of whose
records is usable (all malformed, missing images, over the pack budget) is a ConfigError (exit 2)
at start-up. Found by a job whose eval file held only bad lines: it trained until its first
evaluation and then exited 2, losing the steps since the last checkpoint. The loaders built there
(the packed one, and with `train.eval_generate` the prompt batches) are reused by every evaluation:
building one estimates the split's lengths and logs its skipped records, once per run."""
from __future__ import annotations

from typing import Optional

from megatron_vlm.eval.answer_accuracy import answer_accuracy, answer_engine, answer_loader
from megatron_vlm.eval.heldout_loss import heldout_loader, heldout_loss
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["SFTEvaluator"]


class SFTEvaluator:
    def __init__(self, ctx: RunContext, bundle: ModelBundle, bad_records=None):
        self.ctx, self.bundle, self.bad_records = ctx, bundle, bad_records
        self._engine = None  # built at the first evaluation that generates
        self._loader = None
        self._answers: Optional[tuple] = None
        """(the prompt loader or None without an eval split,) once built: built once per run."""

    def prepare(self) -> None:
        """Open the eval split now (module docstring); ConfigError when none of its records is usable."""
        self._loader = heldout_loader(self.ctx, self.bundle, bad_records=self.bad_records)
        if self.ctx.cfg.train.eval_generate:
            self._answer_loader()

    def _answer_loader(self):
        if self._answers is None:
            self._answers = (answer_loader(self.ctx, self.bundle, bad_records=self.bad_records),)
        return self._answers[0]

    def __call__(self, step: int) -> Optional[dict]:  # noqa: ARG002 (same metrics at every step)
        metrics = dict(heldout_loss(self.ctx, self.bundle, bad_records=self.bad_records, loader=self._loader,
                                    max_batches=self.ctx.cfg.train.eval_max_batches) or {})
        if self.ctx.cfg.train.eval_generate:
            loader = self._answer_loader()
            if loader is not None:
                if self._engine is None:
                    self._engine = answer_engine(self.ctx, self.bundle)
                metrics.update(answer_accuracy(self.ctx, self.bundle, self._engine, loader=loader) or {})
        return metrics or None
