"""Strict TOML -> dataclass loader.

Why strict: a typo in a launch config (`optimizer.lrr`) that is silently ignored costs a whole
cluster run. Every unknown key, wrong type, missing required value or failed `validate()` becomes a
`ConfigError` whose message starts with the dotted path of the offending key; the entry point turns
it into a one-line message and exit code 2.

Supported field types: bool, int, float (ints accepted), str, Literal[...], Optional[X],
list[X], tuple[X, ...], dict[str, X], nested dataclasses, and unions of dataclasses picked by an
explicit `type = "..."` key (each member declares `type: Literal["name"]`).

Floats must be finite. TOML (and so `--set key=nan`) accepts `nan`, `inf` and `-inf`, and no
section's `validate()` can be trusted to notice them: `nan <= 0` is False, so `lr = nan` passes a
"must be > 0" check and `max_grad_norm = nan` would silently disable clipping. The check is made
here, where every float of every section (and every float inside lists, tuples and tables) is
converted, so a section defined anywhere gets it without code of its own.

A section names its filesystem path keys in a `PATHS` class attribute; a leading `~` in their values is
expanded to the home folder here, so every path key gets it alike (the run folder, the model, data and
checkpoint paths).
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import re
import sys
import types
import typing
from typing import Any, Literal, Union

import tomllib

from megatron_vlm.config.keys import dotted as _dotted
from megatron_vlm.config.keys import unknown_key
from megatron_vlm.config.unset import NO_DEFAULT, UNSET_PREFIX, key_default, remove_key
from megatron_vlm.errors import ConfigError

__all__ = ["ConfigError", "from_dict", "to_dict", "apply_overrides", "parse_override_value", "field_docs"]


_MISSING = dataclasses.MISSING


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "none"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _alternatives(tp: Any) -> list[str]:
    """What a union member accepts, as the error lists it: true / false, a Literal's values, else the type's name."""
    if tp is bool:
        return ["true", "false"]
    if typing.get_origin(tp) is Literal:
        return [repr(a) for a in typing.get_args(tp)]
    return [_type_name(tp)]


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def _check_finite(value: Any, path: str) -> None:
    """Untyped values (`Any`) are not converted, but a nan / inf inside them is still an error."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: must be finite, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]")


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        _check_finite(value, path)
        return value
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None and len(non_none) < len(args):
            return None
        if len(non_none) == 1:
            return _convert(value, non_none[0], path)
        dc_members = [a for a in non_none if dataclasses.is_dataclass(a)]
        if dc_members and isinstance(value, dict):
            return _convert_dataclass_union(value, dc_members, path)
        errors = []
        for a in non_none:
            try:
                return _convert(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        finite = [e for e in errors if ": must be finite, got " in e]
        if finite:  # a number of the right type but nan / inf: say so, not "expected float or ..."
            raise ConfigError(finite[0])
        alts = [n for a in non_none for n in _alternatives(a)]
        names = (", ".join(alts[:-1]) + " or " + alts[-1]) if len(alts) > 1 else alts[0]
        raise ConfigError(f"{path}: expected {names}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: must be one of {', '.join(repr(a) for a in args)}, got {value!r}{hint}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table ([{path}]), got {_describe(value)}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        out = [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table, got {_describe(value)}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be finite, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_describe(value)}")
        return value
    raise ConfigError(f"{path}: unsupported field type {tp!r} (a bug in the schema)")


def _convert_dataclass_union(value: dict, members: list, path: str) -> Any:
    names = {}
    for m in members:
        hint = typing.get_type_hints(m).get("type")
        if typing.get_origin(hint) is not Literal:
            raise ConfigError(f"{path}: schema bug: union member {m.__name__} needs `type: Literal[...]`")
        for a in typing.get_args(hint):
            names[a] = m
    if "type" not in value:
        raise ConfigError(f"{path}.type: required to choose between {', '.join(repr(n) for n in names)}")
    t = value["type"]
    if t not in names:
        close = difflib.get_close_matches(str(t), list(names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}.type: must be one of {', '.join(repr(n) for n in names)}, got {t!r}{hint}")
    return from_dict(names[t], value, path)


def _expand_home(value: Any, path: str) -> Any:
    """A path key's `~` / `~user` prefix as the home folder: neither TOML nor the shell (in `--set key=~/x`) expands
    it, and a literal `~` folder in the current one is never what was meant."""
    if not (isinstance(value, str) and value.startswith("~")):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ConfigError(f"{path}: cannot expand {value!r} (no such user or home folder); write the full path")
    return expanded


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass `cls` from a TOML table, strictly. `path` is the dotted prefix for messages."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    prefix = f"{path}." if path else ""
    for key, value in data.items():
        if key not in fields:
            raise unknown_key(cls, key, prefix)
        kwargs[key] = _convert(value, hints[key], f"{prefix}{key}")
        if key in getattr(cls, "PATHS", ()):
            kwargs[key] = _expand_home(kwargs[key], f"{prefix}{key}")
    for name, f in fields.items():
        if name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(f"{prefix}{name}: required value is missing")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # pragma: no cover - schema bugs
        raise ConfigError(f"{path or '<root>'}: {e}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}" if path and not str(e).startswith(prefix) else str(e)) from None
        except ValueError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(prefix) and prefix else f"{prefix}{msg}") from None
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain TOML-able dict (None values are omitted: TOML has no null)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = to_dict(getattr(obj, f.name))
            if v is not None:
                out[f.name] = v
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items() if v is not None}
    return obj


_VALUE_PREFIX = "v = "
"""What a `--set` value is parsed after: a TOML document holds statements, not bare values."""


def _within_value(e: tomllib.TOMLDecodeError) -> str:
    """The decoder's message with a first-line column counted within the value, not after `_VALUE_PREFIX`."""
    return re.sub(r"\(at line 1, column (\d+)\)",
                  lambda m: f"(at line 1, column {max(1, int(m.group(1)) - len(_VALUE_PREFIX))})", str(e))


def parse_override_value(text: str, key: str = "") -> Any:
    """`--set` values are TOML (`3e-4`, `true`, `[1, 2]`, `"x"`); a bare word or path is a string.

    A value that starts as TOML does (a quote, `[`, `{`) but does not parse is a `ConfigError` naming `key`, and
    so is text holding a second TOML line: taken as the bare text, `"runs/x` (unterminated) became a folder with
    a quote in its name and `"C:\\m"` (no TOML escape) a path with its quotes, and `5\nseed = 3` lost its second
    line, all silently."""
    try:
        parsed = tomllib.loads(f"{_VALUE_PREFIX}{text}")
    except tomllib.TOMLDecodeError as e:
        if text.lstrip()[:1] in ('"', "'", "[", "{"):
            raise ConfigError(f"{key}: --set value {text!r} is not one TOML value ({_within_value(e)}); quote a string as "
                              "'text' (taken as written) or \"text\" (with \\\\ for a backslash)") from None
        return text
    if list(parsed) != ["v"]:
        raise ConfigError(f"{key}: --set value {text!r} is not one TOML value (it holds a second line)")
    if isinstance(parsed["v"], (datetime.date, datetime.time)):  # no key takes a TOML date: a date-stamped name
        return text
    return parsed["v"]


_EITHER_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("train", "max_steps"): ("train", "epochs"), ("train", "epochs"): ("train", "max_steps"),
    ("scheduler", "warmup_steps"): ("scheduler", "warmup_ratio"), ("scheduler", "warmup_ratio"): ("scheduler", "warmup_steps"),
}
"""Pairs of keys that give one setting two ways (one of them, never both): a run's length, its warmup. A `--set` of
one replaces the file's other."""


_STAGE_LENGTH = {"max_steps": "epochs", "epochs": "max_steps"}
"""A `[[stages]]` entry's two ways to give its length: `--set stages[0].max_steps=...` replaces the file's epochs."""


def _either_key(steps: list[str | int]) -> tuple[str | int, ...] | None:
    """The key that gives the setting at `steps` the other way (`_EITHER_KEYS`; a stage's length), or None."""
    if len(steps) == 3 and steps[0] == "stages" and isinstance(steps[1], int) and steps[2] in _STAGE_LENGTH:
        return ("stages", steps[1], _STAGE_LENGTH[str(steps[2])])
    return _EITHER_KEYS.get(tuple(map(str, steps)))


_SYNTHETIC_KEYS = ("synthetic_dir", "synthetic_train_size", "synthetic_eval_size", "synthetic_seed", "synthetic_image_size")
_FILE_KEYS = ("train_path", "eval_path", "image_root", "columns")

_SWITCH_OFF_DROPS: dict[tuple[str, ...], dict[Any, tuple[str, ...]]] = {
    ("logging", "wandb"): {False: ("wandb_project", "wandb_mode", "experiment_name")},
    ("checkpoint", "enable"): {False: ("every_steps", "keep_last")},
    ("data", "num_workers"): {0: ("loader_timeout_s", "prefetch_factor")},
    ("data", "type"): {"messages_jsonl": (*_SYNTHETIC_KEYS, "columns"), "hf": _SYNTHETIC_KEYS,
                       "synthetic_vqa": _FILE_KEYS},
    ("eval", "samples"): {0: ("temperature", "top_p", "top_k")},
    ("moe", "enable_moe_load_balancing_training"): {False: ("bias_update_rate",)},
    ("scheduler", "type"): {"constant": ("min_lr_ratio",)},
    ("rl", "rollout_backend"): {"builtin": ("vllm",),  # the [rl.vllm] table; the built-in engine's [rl.rollout] keys
                                "vllm": tuple(f"rollout.{k}" for k in ("weights", "cuda_graphs", "kv_block_size",
                                                                        "kv_cache_blocks", "batch_prompts", "memory_gib"))},
}
"""Switches whose value leaves keys beside them without effect (refused together by the config checks), by value:
a `--set` turning one to such a value drops the file's keys it leaves idle (`--set logging.wandb=false` on a recipe
that names its wandb project, `--set checkpoint.enable=false` on one that sets checkpoint.every_steps / keep_last,
`--set data.num_workers=0` on one that sets data.prefetch_factor, `--set data.type="messages_jsonl"` on the
synthetic demo's data.synthetic_* keys (and "synthetic_vqa" on a recipe's data paths), docs/evaluation.md's
`--set eval.samples=0`, `--set scheduler.type="constant"` on a cosine recipe's min_lr_ratio, `--set
rl.rollout_backend=...` on a recipe for the other engine: its [rl.vllm] table, or the built-in engine's [rl.rollout]
keys, `rl.config.RLConfig._BUILTIN_ENGINE_KEYS`), as the command line is what the user means. A dotted name is a key
of a table below the switch's. Such keys also given with `--set` stay refused."""


_KEY_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")
"""One dotted segment of a `--set` key: a name, then any list indices (`rewards[0]`), as the errors name keys."""


def _key_steps(item: str, key: str, flag: str = "--set") -> list[str | int]:
    """`rl.rewards[0].weight` -> ["rl", "rewards", 0, "weight"]; `flag` names the option in errors."""
    steps: list[str | int] = []
    for seg in key.split("."):
        if not seg:
            raise ConfigError(f"{flag} {item!r}: empty key segment")
        m = _KEY_SEGMENT.fullmatch(seg)
        if m is None:
            form = "section.key" if flag == "--unset" else "section.key=value"
            raise ConfigError(f"{flag} {item!r}: expected {form} (a list entry as key[index])")
        steps.append(m.group(1))
        steps += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    return steps


def _set_value(raw: dict, steps: list[str | int], value: Any, item: str) -> dict | list:
    """Put `value` at `steps` in `raw`, making missing tables on the way; returns the container set in. An index
    (`[0]`, or a number segment `.0` on a list) changes an existing entry of a list (an array of tables), never
    adds one."""
    node: Any = raw
    for k, step in enumerate(steps):
        last, parent = k == len(steps) - 1, _dotted(steps[:k])
        if isinstance(node, list) and isinstance(step, str) and step.isdigit():
            steps[k] = step = int(step)  # `rl.rewards.0.weight`, the dotted spelling of an index
        if isinstance(step, int):
            if not isinstance(node, list):
                raise ConfigError(f"{parent}: not a list, no entry [{step}] to set (from --set {item!r})")
            if step >= len(node):
                raise ConfigError(f"{parent}[{step}]: no such entry (the list has {len(node)}); --set changes an entry, "
                                  f"it adds none: set the whole list, --set {parent}=[...]")
        elif isinstance(node, list):
            raise ConfigError(f"{parent}: a list of tables; name an entry by its index ({parent}[0].{step}) "
                              f"(from --set {item!r})")
        elif not isinstance(node, dict):
            raise ConfigError(f"{parent}: is a value, not a table (from --set {item!r})")
        if last:
            node[step] = value
            return node
        node = node[step] if isinstance(step, int) else node.setdefault(step, {})
    raise AssertionError("unreachable: a key has at least one segment")


def _section_type(schema: Any, steps: list[str | int]) -> Any:
    """The dataclass that the key at `steps` holds in `schema` (a section or sub-table, `Optional` unwrapped), or None:
    a value, a field holding a table of its own (`dict[...]`), an entry of an array of tables, an unknown key."""
    tp = schema
    for k, step in enumerate(steps):
        if isinstance(step, int) or (isinstance(step, str) and step.isdigit()):
            if k == len(steps) - 1 or typing.get_origin(tp) not in (list, tuple):
                return None
            tp = typing.get_args(tp)[0]
            continue
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        tp = typing.get_type_hints(tp).get(step)
        if typing.get_origin(tp) in (Union, types.UnionType):  # Optional[Section]; a union of sections picks by `type`
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = members[0] if len(members) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _expand(schema: Any, steps: list[str | int], value: Any) -> list[tuple[list[str | int], Any]]:
    """`--set` of an inline table on a section of `schema` as one `--set` per key it names (`optimizer={lr=1e-4}` =
    `optimizer.lr=1e-4`), so the file's other keys of that section stay; anything else (and `{}`: the section's
    defaults) as it is given."""
    if schema is None or not isinstance(value, dict) or not value or _section_type(schema, steps) is None:
        return [(steps, value)]
    return [item for key, v in value.items() for item in _expand(schema, [*steps, str(key)], v)]


def _drop_idle(node: Any, steps: list[str | int], value: Any, set_keys: set, removed: set) -> None:
    """The file's keys that `value` of the switch at `steps` leaves without effect (`_SWITCH_OFF_DROPS`), out of
    `node`, the switch's table; each dropped key is added to `removed`."""
    for off, idle in _SWITCH_OFF_DROPS.get(tuple(map(str, steps)), {}).items():
        # the type too: False == 0 (and `is` held for the small ints only by CPython's cache)
        if type(value) is type(off) and value == off and isinstance(node, dict):
            for name in idle:
                *tables, leaf = name.split(".")
                # a key given with --set at or below the idle one (`rl.vllm.max_num_seqs` before the switch)
                # keeps it, to be refused: dropping its table would drop the --set key too
                idle_key = (*steps[:-1], *tables, leaf)
                if any(k[:len(idle_key)] == idle_key for k in set_keys):
                    continue
                table: Any = node
                for t in tables:
                    table = table.get(t) if isinstance(table, dict) else None
                if isinstance(table, dict) and leaf in table:
                    del table[leaf]
                    removed.add(idle_key)


def _parse_item(item: str, schema: Any) -> list[tuple[str, list[str | int], Any]]:
    """One `--set` item as (item, key steps, value) per key it sets (`_expand`); a `~key` item (`--unset key`) as
    (key, steps, `_UNSET`)."""
    if item.lstrip().startswith(UNSET_PREFIX):
        key = item.lstrip()[len(UNSET_PREFIX):].strip()
        if not key:
            raise ConfigError("--unset: needs a key (section.key, or a whole table: section)")
        if "=" in key:
            raise ConfigError(f"--unset {key!r}: takes a key, not key=value (the key is removed; a value is given "
                              "with --set)")
        return [(key, _key_steps(key, key, "--unset"), _UNSET)]
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value (to remove a key: --unset section.key)")
    key, text = item.split("=", 1)
    key = key.strip()
    return [(item, steps, value)
            for steps, value in _expand(schema, _key_steps(item, key), parse_override_value(text.strip(), key))]


_UNSET: Any = object()
"""The value of an `--unset` item among the overrides."""


def apply_overrides(raw: dict, overrides: list[str], schema: Any = None) -> dict:
    """Apply `section.key=value` overrides and `~section.key` removals (`--unset`, config/unset.py) to a raw TOML
    dict (before validation), in the order given. A key names an entry of an array of tables as the errors do
    (`rl.rewards[0].weight=0.5`, `stages[1]={...}`).

    A run length on the command line (`--set train.max_steps=200` on a recipe that sets `train.epochs`, as in
    docs/training.md; a stage's, `--set stages[0].max_steps=10`) replaces the file's other length key, and a warmup (`scheduler.warmup_steps` /
    `warmup_ratio`) the file's other warmup key (`_EITHER_KEYS`): both are refused together, and the command line
    is what the user means. Both given with `--set` stay refused. Likewise a switch turned off with `--set` drops
    the file's keys it leaves idle (`_SWITCH_OFF_DROPS`: `logging.wandb = false` and the wandb project / mode / name,
    `checkpoint.enable = false` and the checkpoint cadence / retention, `data.num_workers = 0` and the loader's
    prefetch / timeout, `data.type` and the keys of the other data sources, ...), and so does a switch unset back to
    such a default (`--unset logging.wandb`: wandb is off by default). A key dropped so may still be unset after.

    With the config's `schema` (the `Config` class), an inline table given to a section sets the keys it names
    (`optimizer={lr=1e-4}` as `optimizer.lr=1e-4`, `_expand`): it replaced the file's whole table, whose other keys
    fell back to their defaults without a word. The schema also names an unset key that no section has, as a
    `--set` of it would be named."""
    set_keys: set[tuple[str | int, ...]] = set()
    removed: set[tuple[str | int, ...]] = set()  # keys the command line took out: unset again, no error
    items = [parsed for item in overrides for parsed in _parse_item(item, schema)]
    for item, steps, value in items:
        if value is _UNSET:
            default = key_default(schema, steps, raw, item) if schema is not None else NO_DEFAULT
            node: Any = remove_key(raw, steps, item, removed)
            key = tuple(steps)
            set_keys = {k for k in set_keys if k[:len(key)] != key}
            removed.add(key)
            if node is not None and default is not NO_DEFAULT:
                _drop_idle(node, steps, default, set_keys, removed)
            continue
        if value == {} and isinstance(value, dict):  # `--set section={}`: the file's table back to its defaults
            removed.add(tuple(steps))  # its keys are taken out: a later unset of one is no error
        node = _set_value(raw, steps, value, item)
        set_keys.add(tuple(steps))
        other = _either_key(steps)
        if other is not None and other not in set_keys and isinstance(node, dict) and other[-1] in node:
            del node[other[-1]]
            removed.add(other)
        _drop_idle(node, steps, value, set_keys, removed)
    return raw


def field_docs(cls: type) -> dict[str, str]:
    """Per-field docstrings: the string literal that follows each field in the class body."""
    import ast
    import inspect
    import textwrap

    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def die(msg: str) -> typing.NoReturn:
    """Print a config error and exit 2 (no traceback)."""
    print(f"config error: {msg}", file=sys.stderr)
    raise SystemExit(2)
