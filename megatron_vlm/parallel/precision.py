"""Which dtype a job computes in: `[train] precision` resolved against the device, in one place.

"auto" means fp32 on the CPU (the reference numerics the tests compare against) and bf16 on
accelerators; bf16 is the compute dtype of FSDP2's mixed-precision policy while the optimizer
keeps master weights in `[model] dtype`. "fp8" is bf16 training here (its float8 matmuls live inside
the converted linear layers, training/fp8.py), so it resolves to "bf16".
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

__all__ = ["resolve_precision", "compute_dtype", "mixed_param_dtype"]


def resolve_precision(precision: str, device: torch.device) -> Literal["fp32", "bf16"]:
    if precision == "auto":
        return "fp32" if device.type == "cpu" else "bf16"
    if precision == "fp8":
        return "bf16"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"train.precision: expected 'auto', 'fp32', 'bf16' or 'fp8', got {precision!r}")
    return precision  # type: ignore[return-value]


def compute_dtype(precision: str, master_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype activations and KV caches use: bf16 under bf16 precision, else the master weights'."""
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else master_dtype


def mixed_param_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The dtype the trainer's mixed precision casts the parameters and the units' inputs to (FSDP2's `param_dtype`,
    or `parallel.fsdp = false`'s bf16 weights and input casts): bf16 under bf16 precision; None in full precision
    (nothing is cast, whatever `[model] dtype` holds). A rollout copy of the policy casts as the trainer does
    (models/common/parallel_plan.py `copy_input_casts`)."""
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else None
