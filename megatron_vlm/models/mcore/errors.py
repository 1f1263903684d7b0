"""`McoreBackendError`: the model or run cannot use megatron-core layers.

Its own module below `layer.py`, `hybrid.py` and `moe_layer.py`, which all raise it: so none of them imports
another only for the error class (an import cycle)."""
from __future__ import annotations

from megatron_vlm.errors import ConfigError

__all__ = ["McoreBackendError"]


class McoreBackendError(ConfigError):
    """The model or run cannot use megatron-core layers (a config error: exit 2)."""
