"""`--unset KEY`: remove a key the config file sets, so that its default applies.

Why: TOML has no null, so no `--set` value can take a key back out of a recipe (`train.max_steps` when the run
should give `train.epochs`, a recipe's `checkpoint.resume_from`, a whole optional table such as `[eval]` or
`[rl.kl]`). An unset is applied in command-line order with the `--set` items (`--unset eval --set eval.samples=1`
starts the table afresh) and travels in the same list as `~KEY`, hydra's spelling, which `--set '~KEY'` accepts too.

Refused (exit 2 naming the key): a key no section has (the message a `--set` of it gets), an entry of a list
(`rl.rewards[1]`: its neighbours would shift; set the whole list), and a key the config does not set. The last is
an error, as hydra's `~key` is, because an unset that finds nothing is most often a misspelt or misplaced key (an
`[[stages]]` key given for the main run, a table the recipe names differently) and the run would go on as if it had
worked. A key that an earlier item of the command line removed (`--set train.epochs=2` drops the file's
`train.max_steps`, `_EITHER_KEYS`) is no error: the user's intent is already met.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from megatron_vlm.config.keys import dotted as _dotted
from megatron_vlm.config.keys import unknown_key
from megatron_vlm.errors import ConfigError

__all__ = ["UNSET_PREFIX", "NO_DEFAULT", "key_default", "remove_key"]

UNSET_PREFIX = "~"
"""An override item that starts with it removes the key after it (`~train.max_steps`); a `--set` key never does."""

NO_DEFAULT: Any = dataclasses.MISSING
"""`key_default` of a key that is no field of a section (an entry of a `dict[...]` table, a required key)."""


def _members(tp: Any) -> list[Any]:
    """The types a field may hold: `Optional[X]` as X, a union as its members, anything else as itself."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _pick(members: list[Any], node: Any, step: str) -> Any:
    """Of a union of sections, the member the file's `type` picks, else the first that has `step`, else the first."""
    tables = [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]
    if not tables:
        return members[0]
    for m in tables:
        hint = typing.get_type_hints(m).get("type")
        if isinstance(node, dict) and typing.get_origin(hint) is typing.Literal and node.get("type") in typing.get_args(hint):
            return m
    return next((m for m in tables if step in {f.name for f in dataclasses.fields(m) if f.init}), tables[0])


def key_default(schema: Any, steps: list[str | int], raw: dict, item: str) -> Any:
    """The default of the key at `steps` in `schema` (`NO_DEFAULT` where it has none); a `ConfigError` for a key no
    section has, with the message `--set` of it gets (`unknown_key`). `raw` picks a union's member by its `type`."""
    tp: Any = schema
    node: Any = raw
    default: Any = NO_DEFAULT
    for k, step in enumerate(steps):
        members = _members(tp)
        tp = members[0] if len(members) == 1 else _pick(members, node, str(step))
        parent = _dotted(steps[:k])
        if tp is Any:
            return NO_DEFAULT
        if isinstance(step, int) or (isinstance(step, str) and step.isdigit() and typing.get_origin(tp) in (list, tuple)):
            if typing.get_origin(tp) not in (list, tuple):
                raise ConfigError(f"{parent}: not a list, no entry [{step}] to unset (from --unset {item!r})")
            tp, default = typing.get_args(tp)[0], NO_DEFAULT
            node = node[int(step)] if isinstance(node, list) and int(step) < len(node) else None
            continue
        if typing.get_origin(tp) in (list, tuple):
            raise ConfigError(f"{parent}: a list of tables; name an entry by its index ({parent}[0].{step}) "
                              f"(from --unset {item!r})")
        if typing.get_origin(tp) is dict:
            tp, default = typing.get_args(tp)[1], NO_DEFAULT
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
            if step not in fields:
                raise unknown_key(tp, step, f"{parent}." if parent else "")
            f = fields[step]
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else NO_DEFAULT)
            tp = typing.get_type_hints(tp)[step]
        else:
            raise ConfigError(f"{parent}: is a value, not a table (from --unset {item!r})")
        node = node.get(step) if isinstance(node, dict) else None
    return default


def remove_key(raw: dict, steps: list[str | int], item: str, removed: set[tuple[str | int, ...]]) -> dict | None:
    """Take the key at `steps` out of `raw`; returns the table it was in, or None where an earlier item of the command
    line removed it (a key in `removed`, or a table above it). A list entry, or a key not there, is a `ConfigError`."""
    if isinstance(steps[-1], int):
        whole = _dotted(steps[:-1])
        raise ConfigError(f"{_dotted(steps)}: --unset removes a key, not an entry of a list (the entries after it "
                          f"would shift); set the whole list: --set {whole}=[...]")
    node: Any = raw
    for k, step in enumerate(steps):
        if isinstance(node, list) and isinstance(step, str) and step.isdigit():
            steps[k] = step = int(step)  # `rl.rewards.0.weight`, the dotted spelling of an index
            if k == len(steps) - 1:
                return remove_key(raw, steps, item, removed)
        if isinstance(step, int):
            found = isinstance(node, list) and step < len(node)
        else:
            found = isinstance(node, dict) and step in node
        if not found:
            if isinstance(step, int) and isinstance(node, list):
                raise ConfigError(f"{_dotted(steps[:k + 1])}: no such entry (the list has {len(node)}; from --unset "
                                  f"{item!r})")
            break
        if k == len(steps) - 1:
            del node[step]
            return node
        node = node[step]
    if any(tuple(steps[:n]) in removed for n in range(1, len(steps) + 1)):
        return None
    raise ConfigError(f"{_dotted(steps)}: --unset: the config does not set it, nothing to unset (its default "
                      "applies already)")
