#!/usr/bin/env python3
"""Print the `[train] output_dir` a config + `--set` / `--unset` overrides ask for, or nothing if neither sets it.

train.sbatch calls this to decide the run folder before it starts torchrun: an explicit
output_dir (TOML or `--set train.output_dir=...`, the last one wins) is used as given, otherwise
the job gets `runs/<job name>-<job id>/`. Only the standard library is used (no torch import on
the batch host), and `--set` values are read the way launch/pretrain_vlm.py reads them: a TOML
value (`"x"`, `'x'`) or else the bare text.

    python3 resolve_output_dir.py <config.toml> [--set section.key=value ...] [--unset section.key ...]
"""
from __future__ import annotations

import datetime
import os
import sys

import tomllib


def override_value(text: str, key: str = "train.output_dir"):
    """As megatron_vlm.config.loader.parse_override_value: TOML, else the bare text; text that starts as TOML
    (a quote, `[`, `{`) and does not parse, or holds a second line, is refused."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError as e:
        if text.lstrip()[:1] in ('"', "'", "[", "{"):
            raise SystemExit(f"resolve_output_dir: {key}: --set value {text!r} is not one TOML value ({e})") from None
        return text
    if list(parsed) != ["v"]:
        raise SystemExit(f"resolve_output_dir: {key}: --set value {text!r} is not one TOML value (it holds a second line)")
    if isinstance(parsed["v"], (datetime.date, datetime.time)):  # a bare date is its text, as the loader reads it
        return text
    return parsed["v"]


def overrides_from_argv(args: list[str]) -> list[str]:
    """The `section.key=value` items of `--set X` / `--set=X` and the `~section.key` items of `--unset X` /
    `--unset=X` (as launch/pretrain_vlm.py passes them on), in the order given. A `--config` is refused: the entry
    point would read that file, not the one the run folder was picked from."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--config" or a.startswith("--config="):  # the entry point refuses a second one too (exit 2)
            raise SystemExit("resolve_output_dir: --config among the training arguments: the config is train.sbatch's "
                             "first argument (one config file per run; change its keys with --set / --unset)")
        for flag, mark in (("--set", ""), ("--unset", "~")):
            if a == flag:
                if i + 1 >= len(args):
                    raise SystemExit(f"resolve_output_dir: {flag} at the end of the command line has no value")
                out.append(mark + args[i + 1])
                i += 1
            elif a.startswith(f"{flag}="):
                out.append(mark + a[len(flag) + 1:])
        i += 1
    return out


def resolve_output_dir(config_path: str, args: list[str]) -> str | None:
    try:
        with open(config_path, encoding="utf-8-sig") as f:  # as the config loader reads it (a byte order mark dropped)
            raw = tomllib.loads(f.read())
    except FileNotFoundError:
        raise SystemExit(f"resolve_output_dir: config file {config_path!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"resolve_output_dir: {config_path}: not valid TOML: {e}") from None
    train = raw.get("train", {})
    value = train.get("output_dir") if isinstance(train, dict) else None
    for item in overrides_from_argv(args):
        key, sep, text = item.partition("=")
        name = key.strip()
        if not sep and name.startswith("~") and name[1:].strip() in ("train.output_dir", "train"):
            value = None  # --unset: the key (or its table) removed; spaces around the key dropped, as the loader does
        elif sep and key.strip() == "train.output_dir":
            value = override_value(text.strip())
        elif sep and key.strip() == "train":  # an inline table sets the keys it names (config/loader.py `_expand`)
            table = override_value(text.strip(), "train")
            if table == {}:  # `{}` replaces the whole section (config/loader.py): output_dir is then not set
                value = None
            elif isinstance(table, dict) and "output_dir" in table:
                value = table["output_dir"]
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():  # as the config refuses it: before a log folder is made
        raise SystemExit(f"resolve_output_dir: train.output_dir must be a non-empty string, got {value!r}")
    if value.startswith("~"):  # the config loader expands a path key's ~ (megatron_vlm/config/loader.py)
        expanded = os.path.expanduser(value)
        if expanded.startswith("~"):
            raise SystemExit(f"resolve_output_dir: train.output_dir: cannot expand {value!r} (no such user or home folder)")
        value = expanded
    return value


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    value = resolve_output_dir(argv[0], argv[1:])
    if value is not None:
        print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
