#!/usr/bin/env python
"""Generate the config reference (docs/config_reference.md) from the section dataclasses' field docstrings.

    python launch/gen_config_reference.py            # print the markdown
    python launch/gen_config_reference.py --write    # rewrite the block in docs/config_reference.md
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_vlm.config import Config  # noqa: E402
from megatron_vlm.config.loader import field_docs  # noqa: E402

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "config_reference.md"


def _type_str(tp) -> str:
    s = str(tp).replace("typing.", "")
    return getattr(tp, "__name__", s) if isinstance(tp, type) else s


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if f.default is not None else "unset"
    if f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        return "(table)" if dataclasses.is_dataclass(v) else repr(v)
    return "**required**"


def _section(name: str, cls) -> list[str]:
    """The table of `[name]`, followed by the tables of its sub-tables (`[name.field]`, e.g. `[rl.rollout]`)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # fields a base class declares (the reward tables' `weight`, `name`)
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    hints = typing.get_type_hints(cls)
    heading = name if name.startswith("[[") else f"[{name}]"
    lines = [f"## {heading}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        tp = _type_str(hints[f.name]).replace("|", "\\|")
        doc = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{tp}` | `{_default(f)}` | {doc} |")
        # a table, an optional table (Optional[X]) or an array of one kind of table (list[X]); an array of tables
        # picked by `type =` (list[Union[...]], `[[rl.rewards]]`) gives one section per kind
        sub = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        sub_cls = sub[0] if len(sub) == 1 else hints[f.name]
        if isinstance(sub_cls, type) and dataclasses.is_dataclass(sub_cls):
            nested.append((f"{name}.{f.name}", sub_cls))
        elif typing.get_origin(hints[f.name]) is list:
            for member in typing.get_args(sub_cls):
                if dataclasses.is_dataclass(member) and "type" in member.__dataclass_fields__:
                    kind = member.__dataclass_fields__["type"].default
                    nested.append((f'[[{name}.{f.name}]] type = "{kind}"', member))
    lines.append("")
    for sub_name, sub_cls in nested:
        lines += _section(sub_name, sub_cls)
    return lines


def render() -> str:
    hints = typing.get_type_hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        cls = args[0] if args else tp
        out += _section(f.name, cls)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite the generated block of {REFERENCE.name} instead of printing it")
    write = p.parse_args(argv).write
    md = render()
    if write:
        text = REFERENCE.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        REFERENCE.write_text(f"{head}{BEGIN}\n{md}{END}{tail}")
    else:
        print(md)


if __name__ == "__main__":
    main()
