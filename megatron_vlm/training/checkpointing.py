"""Checkpoints of a training run, as the loop uses them: resume (`checkpoint.resume`), save at a
step with the loop's data state, and the final Hugging Face export.

A checkpoint holds the model and optimizer (DCP, sharded), and per rank an extra file with the
scheduler state, the data state of the job kind (SFT: the loader position; GRPO: the next step,
seed and prompt count), the RNG states and the step (`checkpoint.manager.CheckpointManager`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_vlm.checkpoint.export import export_hf_from_state_dict
from megatron_vlm.checkpoint.manager import CheckpointManager, full_model_state_dict
from megatron_vlm.parallel.collectives import barrier
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.optim import OptimState, load_scheduler_state

__all__ = ["Checkpointer", "ResumePoint"]

log = logging.getLogger("megatron_vlm")


@dataclass(frozen=True)
class ResumePoint:
    step: int
    """Optimizer steps already taken."""
    data: dict
    """The data state saved with the checkpoint (empty when it has none)."""


class Checkpointer:
    def __init__(self, ctx: RunContext, wrapper, optim: OptimState):
        self.cfg = ctx.cfg.checkpoint
        self.model_path = ctx.cfg.model.path
        self.is_main = ctx.env.is_main
        self.wrapper, self.optim = wrapper, optim
        self.manager = CheckpointManager(ctx.run_dir, self.cfg.keep_last, ctx.env.rank)

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enable)

    @property
    def export_at_end(self) -> bool:
        """`checkpoint.export_hf`: write `<run>/hf` when the run finishes."""
        return bool(self.cfg.export_hf)

    def periodic_due(self, step: int) -> bool:
        """`checkpoint.every_steps` says to save after `step` (the loop skips the final step: saved once at the end)."""
        return self.enabled and bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def resume(self) -> Optional[ResumePoint]:
        """Load the checkpoint `checkpoint.resume` names (auto: the latest complete one) into the model,
        optimizer and scheduler, and restore the RNG states; None when starting fresh."""
        path = self.manager.resolve_resume(self.cfg.resume) if self.enabled else None
        if path is None:
            return None
        extra = self.manager.load(path, self.wrapper, self.optim.optimizer)
        load_scheduler_state(self.optim.scheduler, extra["scheduler"])
        log.info("Resumed from checkpoint: step=%d (%s)", extra["step"], path)
        return ResumePoint(step=int(extra["step"]), data=extra.get("data", {}))

    def save(self, step: int, data_state: dict) -> None:
        self.manager.save(step, self.wrapper, self.optim.optimizer,
                          {"data": data_state, "scheduler": self.optim.scheduler.state_dict()})

    def export_hf(self, out_dir: Path) -> None:
        """Gather the full weights and write a Hugging Face folder (rank 0)."""
        sd = full_model_state_dict(self.wrapper)
        if self.is_main:
            sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            export_hf_from_state_dict(sd, self.model_path, out_dir)
            log.info("exported Hugging Face model to %s", out_dir)
        barrier()
