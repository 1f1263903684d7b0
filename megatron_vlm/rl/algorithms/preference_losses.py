"""The preference-loss family, listed with the other algorithm families: the registry lives with the DPO step
(`megatron_vlm/training/dpo/loss_registry.py`: `training/` does not import `rl/`) and is re-exported here."""
from __future__ import annotations

from megatron_vlm.training.dpo.loss_registry import PREFERENCE_LOSSES, PreferenceLossFn

__all__ = ["PREFERENCE_LOSSES", "PreferenceLossFn"]
