"""Naming config keys in errors: the dotted spelling of a key and the message for one no section has.

Its own module so that the loader (`--set`, the file) and `--unset` (config/unset.py) share one wording.
"""
from __future__ import annotations

import dataclasses
import difflib

from megatron_vlm.errors import ConfigError

__all__ = ["dotted", "unknown_key"]


def dotted(steps: list[str | int]) -> str:
    """`["rl", "rewards", 0, "weight"]` -> `rl.rewards[0].weight`, as the errors name keys."""
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" if k else s for k, s in enumerate(steps))


def unknown_key(cls: type, key: str, prefix: str) -> ConfigError:
    """The error for `key`, not a field of section `cls` (under the dotted `prefix`): where it moved, else the
    closest field or the valid ones. One message for the file, `--set` and `--unset` alike."""
    moved = getattr(cls, "MOVED", {})  # a section's keys that moved to a sub-table: named, never read
    if key in moved:
        new = f"{prefix}{moved[key]}"
        table, _, name = new.rpartition(".")
        return ConfigError(f"{prefix}{key}: moved to {new} (write `{name} = ...` under [{table}])")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
    return ConfigError(f"{prefix}{key}: unknown key{hint}")
