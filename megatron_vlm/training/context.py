"""What every part of a run shares and nothing changes after start: the resolved config, the process
group (`DistEnv`), the run folder and the stop flag that SIGTERM / SIGUSR1 raise.

The SFT and GRPO loops, the evaluators and the checkpointer receive this one small object instead of
a shared mutable job; model, optimizer, checkpoints and metrics live in their own objects.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_vlm.host_copies import moved_to
from megatron_vlm.parallel import DistEnv
from megatron_vlm.training.signals import StopFlag

if TYPE_CHECKING:  # megatron_vlm.config imports training's section dataclasses (training.stages, moe_balancing)
    from megatron_vlm.config import Config

__all__ = ["RunContext", "seed_everything"]


@dataclass(frozen=True)
class RunContext:
    cfg: Config
    """The resolved job config (`megatron_vlm.config`)."""
    env: DistEnv
    """Rank, world size and device of this process."""
    run_dir: Path
    """`train.output_dir`: config.toml, metrics, checkpoints/, hf/."""
    stop: StopFlag = field(default_factory=StopFlag)
    """Set by SIGTERM / SIGUSR1; the loop checks it at step boundaries."""

    @property
    def device(self) -> torch.device:
        return self.env.device

    def to_device(self, batch: dict) -> dict:
        """The tensors of `batch` on this rank's device (other entries as they are), the small ones keeping their
        host copy (megatron_vlm/host_copies.py: the model and the steps read counts, grids and bounds from it, with
        no device sync)."""
        return moved_to(batch, self.env.device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
