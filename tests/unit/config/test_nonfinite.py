"""Non-finite numbers in a config are errors naming the key, for every float key of every section.

TOML accepts `nan`, `inf` and `-inf` (so does `--set key=nan`), and a section's own range checks
let nan through (`nan <= 0` is False): `lr = nan` trained on NaN and `max_grad_norm = nan` turned
clipping off. The list of keys is built from the `Config` schema itself, so a float key added to any
section later is covered without editing this file.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any, Optional

import pytest

from megatron_vlm.config import Config, ConfigError, load_config_dict
from megatron_vlm.config.loader import from_dict
from tests.unit.launch_in_process import run_launcher

BASE = {
    "model": {"path": "/tmp/some-model"},
    "data": {"type": "synthetic_vqa"},
    "train": {"max_steps": 3},
    "optimizer": {"lr": 1e-4},
}


def _members(tp: Any) -> list:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _float_keys(cls: type) -> list[tuple[str, list, Any]]:
    """(dotted key, raw-dict route, value template) of every float in the schema. A route step is a
    key, or ("list", table) for a list of tables whose first entry is `table`."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for tp in _members(hints[f.name]):
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if tp is float:
                out.append((f.name, [f.name], None))
            elif origin in (tuple, list) and args and args[0] is float:
                n = len(args) if origin is tuple and args[-1] is not Ellipsis else 1
                out.append((f"{f.name}[0]", [f.name], ("seq", n)))
            elif dataclasses.is_dataclass(tp):
                out += [(f"{f.name}.{k}", [f.name, *route], v) for k, route, v in _float_keys(tp)]
            elif origin is list and args:
                for member in _members(args[0]):
                    if dataclasses.is_dataclass(member):
                        t = typing.get_args(typing.get_type_hints(member).get("type", None))
                        head = {"type": t[0]} if t else {}
                        out += [(f"{f.name}[0].{k}", [f.name, ("list", head), *route], v)
                                for k, route, v in _float_keys(member)]
    return out


FLOAT_KEYS = _float_keys(Config)


def _raw_with(route: list, template: Any, bad: float) -> dict:
    raw = copy.deepcopy(BASE)
    node, i = raw, 0
    while i < len(route) - 1:
        if isinstance(route[i + 1], tuple):  # a list of tables: one entry, with its `type`
            entry = dict(route[i + 1][1])
            node[route[i]] = [entry]
            node, i = entry, i + 2
        else:
            node, i = node.setdefault(route[i], {}), i + 1
    node[route[-1]] = [bad] * template[1] if template else bad
    return raw


def test_the_schema_walk_finds_the_known_float_keys():
    keys = {k for k, _, _ in FLOAT_KEYS}
    for k in ("optimizer.lr", "train.max_grad_norm", "optimizer.betas[0]", "data.fps", "rl.loss.kl_coef",
              "rl.eval.temperature", "rl.rewards[0].weight", "moe.aux_loss_coef"):
        assert k in keys, sorted(keys)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key, route, template", FLOAT_KEYS, ids=[k for k, _, _ in FLOAT_KEYS])
def test_every_float_key_rejects_non_finite(key, route, template, bad):
    with pytest.raises(ConfigError) as e:
        load_config_dict(_raw_with(route, template, bad))
    assert str(e.value).startswith(f"{key}: must be finite, got "), str(e.value)


def test_finite_values_still_load():
    cfg = load_config_dict(copy.deepcopy(BASE), ["optimizer.lr=3e-4", "train.max_grad_norm=0.5"])
    assert cfg.optimizer.lr == 3e-4 and cfg.train.max_grad_norm == 0.5


@dataclasses.dataclass(kw_only=True)
class Inner:
    w: float = 1.0
    """weight"""


@dataclasses.dataclass(kw_only=True)
class Outer:
    xs: list[float] = dataclasses.field(default_factory=list)
    """floats"""
    table: dict[str, float] = dataclasses.field(default_factory=dict)
    """floats by name"""
    anything: dict[str, Any] = dataclasses.field(default_factory=dict)
    """untyped"""
    maybe: Optional[float] = None
    """optional"""
    union: float | str = "x"
    """number or word"""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """nested table"""


def test_nested_floats_in_lists_tables_and_untyped_values():
    cases = [
        ({"xs": [1.0, math.nan]}, "xs[1]: must be finite, got nan"),
        ({"table": {"a": 1.0, "b": math.inf}}, "table.b: must be finite, got inf"),
        ({"anything": {"k": [1, {"deep": -math.inf}]}}, "anything.k[1].deep: must be finite, got -inf"),
        ({"maybe": math.nan}, "maybe: must be finite, got nan"),
        ({"union": math.nan}, "union: must be finite, got nan"),
        ({"inner": {"w": math.nan}}, "inner.w: must be finite, got nan"),
    ]
    for raw, expect in cases:
        with pytest.raises(ConfigError) as e:
            from_dict(Outer, raw, "sec")
        assert str(e.value) == f"sec.{expect}"
    assert from_dict(Outer, {"union": "word", "xs": [1, 2.5]}, "sec").xs == [1.0, 2.5]


@pytest.mark.parametrize("setting, expect", [
    ("optimizer.lr=nan", "config error: optimizer.lr: must be finite, got nan"),
    ("optimizer.lr=inf", "config error: optimizer.lr: must be finite, got inf"),
    ("optimizer.lr=-inf", "config error: optimizer.lr: must be finite, got -inf"),
    ("train.max_grad_norm=nan", "config error: train.max_grad_norm: must be finite, got nan"),
    ("optimizer.betas=[0.9, nan]", "config error: optimizer.betas[1]: must be finite, got nan"),
])
def test_cli_set_non_finite_exits_2_naming_the_key(tmp_path, setting, expect):
    import tomli_w

    cfg = tmp_path / "x.toml"
    cfg.write_text(tomli_w.dumps(BASE))
    r = run_launcher("pretrain_vlm", ["--config", cfg, "--set", setting], cwd=None)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == expect
    assert "Traceback" not in r.stderr


def test_cli_non_finite_in_the_toml_file_exits_2(tmp_path):
    cfg = tmp_path / "x.toml"
    cfg.write_text('[model]\npath = "/tmp/m"\n[data]\ntype = "synthetic_vqa"\n[train]\nmax_steps = 3\n'
                   "max_grad_norm = nan\n[optimizer]\nlr = 1e-4\n")
    r = run_launcher("pretrain_vlm", ["--config", cfg], cwd=None)
    assert r.returncode == 2 and r.stderr.strip() == "config error: train.max_grad_norm: must be finite, got nan"
