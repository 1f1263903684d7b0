"""docs/migrating.md cannot rot: every key of ours its mapping tables name (the "megatron-vlm" column) is a key of
the config schema, and a value written beside it (`rl.loss.loss_agg = "seq-mean"`) is one the key accepts; a row
with no key of ours says "none"."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import tomllib

from megatron_vlm.config import Config
from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS
from megatron_vlm.rl.algorithms.policy_losses import POLICY_LOSSES

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
OURS = "megatron-vlm"
REGISTRIES = {"rl.policy_loss": POLICY_LOSSES, "rl.advantage": ADVANTAGE_ESTIMATORS}
SPAN = re.compile(r"`([^`]+)`")
KEY = re.compile(r"^(?P<table>\[\[[a-z_.]+\]\] )?(?P<key>[a-z_0-9]+(?:\.[a-z_0-9]+)*)(?: = (?P<value>.+))?$")


def mapping_rows(text: str) -> list[tuple[int, str]]:
    """(line, our cell) of each body row of the tables whose first header cell names verl or TRL."""
    rows, col, lines = [], None, text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            col = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if col is None and n < len(lines) and lines[n].startswith("|---"):  # a header row
            col = cells.index(OURS) if OURS in cells and cells[0] in ("verl", "TRL") else -1
        elif col is not None and col >= 0 and not line.startswith("|---"):
            rows.append((n, cells[col]))
    return rows


def _members(tp) -> list:
    """The dataclasses (or the leaf type) a field annotation holds: Optional, list and unions unwrapped."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(tp) if a is not type(None) for m in _members(a)]
    if origin is list:
        return _members(typing.get_args(tp)[0])
    return [tp]


def resolve(dotted: str) -> list:
    """The annotations `dotted` names in the config schema (one per union member that has it); KeyError if none."""
    current = [Config]
    for part in dotted.split("."):
        found = []
        for cls in current:
            if dataclasses.is_dataclass(cls):
                hints = typing.get_type_hints(cls)
                if part in hints:
                    found.append(hints[part])
        if not found:
            raise KeyError(dotted)
        current = [m for tp in found for m in _members(tp)]
    return current


def accepts(dotted: str, leaves: list, value) -> bool:
    if dotted in REGISTRIES:
        return value in REGISTRIES[dotted]
    for leaf in leaves:
        if typing.get_origin(leaf) is typing.Literal:
            if value in typing.get_args(leaf):
                return True
        elif isinstance(leaf, type) and isinstance(value, leaf) and not (leaf is int and isinstance(value, bool)):
            return True
    return False


def problems(text: str) -> list[str]:
    bad = []
    rows = mapping_rows(text)
    if not rows:
        return ["no mapping tables found"]
    for n, cell in rows:
        spans = SPAN.findall(cell)
        if not spans:
            if not cell.startswith("none"):
                bad.append(f"line {n}: no key of ours and not 'none': {cell!r}")
            continue
        for span in spans:
            m = KEY.match(span)
            if not m:
                bad.append(f"line {n}: `{span}` is not a key")
                continue
            key = m["key"] if not m["table"] else m["table"].strip("[] ") + "." + m["key"]
            try:
                leaves = resolve(key)
            except KeyError:
                bad.append(f"line {n}: `{span}`: {key} is not a config key")
                continue
            if m["value"] is not None:
                value = tomllib.loads(f"v = {m['value']}")["v"]
                if not accepts(key, leaves, value):
                    bad.append(f"line {n}: `{span}`: {key} does not accept {value!r}")
    return bad


def test_every_key_in_the_guide_exists():
    text = GUIDE.read_text()
    assert len(mapping_rows(text)) > 100
    assert problems(text) == []


@pytest.mark.parametrize("cell, expect", [
    ("`rl.batch.group_sise`", "rl.batch.group_sise is not a config key"),
    ("`rl.loss.loss_agg = \"seq-mean-token-sum\"`", "does not accept 'seq-mean-token-sum'"),
    ("`rl.policy_loss = \"sapo\"`", "does not accept 'sapo'"),
    ("`[[rl.rewards]] type = \"verl\"`", "does not accept 'verl'"),
    ("`[[rl.rewards]] functon`", "rl.rewards.functon is not a config key"),
    ("not mapped", "not 'none'"),
])
def test_the_checker_sees_a_wrong_row(cell, expect):
    good = "| verl | megatron-vlm | notes |\n|---|---|---|\n| `a` | `rl.batch.group_size`, `[[rl.rewards]] type = \"math\"` | |\n"
    assert problems(good) == []
    assert expect in " ".join(problems(good + f"| `b` | {cell} | |\n"))
