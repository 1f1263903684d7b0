"""`Registry`, the typed name -> implementation table of every algorithm family (defined in `megatron_vlm/registry.py`,
below `rl/` and `training/`, so that the DPO step's preference losses register the same way without `training/`
importing `rl/`)."""
from __future__ import annotations

from megatron_vlm.registry import Registry

__all__ = ["Registry"]
