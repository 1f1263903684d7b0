"""The range checks that config tables and value objects make in `validate`, with one message shape:
"<key>: must be >= <bound>, got <value>" (the config loader puts the table in front: "data.num_workers: ...").

Why a top-level module: the tables live in the packages they configure (data, training, inference, rl), which
must not import `megatron_vlm.config` (it imports their tables; tests/unit/test_import_graph.py)."""
from __future__ import annotations

from typing import Any

__all__ = ["at_least", "above"]


def at_least(obj: Any, bound: float, *names: str) -> None:
    """ValueError naming the first of the attributes `names` of `obj` whose value is below `bound`."""
    for name in names:
        value = getattr(obj, name)
        if value < bound:
            raise ValueError(f"{name}: must be >= {bound}, got {value}")


def above(obj: Any, bound: float, *names: str) -> None:
    """ValueError naming the first of the attributes `names` of `obj` whose value is not above `bound`."""
    for name in names:
        value = getattr(obj, name)
        if value <= bound:
            raise ValueError(f"{name}: must be > {bound}, got {value}")
