"""The functions of this repository's modules as they were at a git revision, switched in and out of the running
process: an A/B timing of a change in one process (the same model, optimizer state, allocator and CPU caches),
its rounds interleaved, on a machine whose speed drifts.

`OldCode(rev)` reads every module of `megatron_vlm/` that differs between `rev` and the working tree (`git diff
--name-only`; `megatron_vlm/testing/`, the read counter, stays this tree's), executes its old source into a separate module object, and lists the functions and methods whose
source differs. `with old:` binds those old functions wherever the process holds the new ones (module globals,
class attributes); leaving the block binds the new ones back. The old functions see the old versions of each other
(their globals are the old modules', rebound where a name is a changed function) and the new versions of
everything that did not change. What it cannot switch: changed module-level values that are not functions, new
classes or fields (a method that uses `super()` of an old class body is left out: its `__class__` is the old class).
"""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _definitions(source: str) -> dict[str, str]:
    """`name` or `Class.name` -> the source of each top-level function and method."""
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = ast.get_source_segment(source, node) or ""
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = ast.get_source_segment(source, item) or ""
    return out


class OldCode:
    """The changed functions of `megatron_vlm` at `rev`; a context manager that has the process run them."""

    def __init__(self, rev: str):
        self.rev = rev
        changed = [p for p in _git("diff", "--name-only", rev, "--", "megatron_vlm").split()
                   if p.endswith(".py") and (REPO / p).is_file() and not p.startswith("megatron_vlm/testing/")]
        self.swaps: list[tuple[Any, str, Any, Any]] = []  # (namespace, name, new, old)
        olds: dict[Any, Any] = {}  # new function -> old function
        modules = []
        for path in changed:
            name = path[:-3].replace("/", ".").removesuffix(".__init__")
            try:
                old_source = _git("show", f"{rev}:{path}")
            except subprocess.CalledProcessError:
                continue  # a module the revision does not have
            new_source = (REPO / path).read_text()
            new_mod = importlib.import_module(name)
            old_mod = types.ModuleType(name)
            old_mod.__dict__.update(__file__=str(REPO / path), __package__=name.rpartition(".")[0])
            exec(compile(old_source, f"{rev}:{path}", "exec"), old_mod.__dict__)
            old_defs, new_defs = _definitions(old_source), _definitions(new_source)
            for qual, src in old_defs.items():
                if new_defs.get(qual, src) == src:
                    continue
                owner, _, attr = qual.rpartition(".")
                new_ns = getattr(new_mod, owner) if owner else new_mod
                old_ns = getattr(old_mod, owner) if owner else old_mod
                new_fn, old_fn = new_ns.__dict__.get(attr), old_ns.__dict__.get(attr)
                if new_fn is None or old_fn is None:
                    continue
                if owner and "super()" in src:
                    continue  # its __class__ cell is the old class: it cannot run on the new class's instances
                olds[new_fn] = old_fn
                if owner:
                    self.swaps.append((new_ns, attr, new_fn, old_fn))
            modules.append(old_mod)
        for old_mod in modules:  # the old functions call each other's old versions
            for key, value in list(old_mod.__dict__.items()):
                if _hashable(value) and value in olds:
                    old_mod.__dict__[key] = olds[value]
        for mod in list(sys.modules.values()):  # wherever the process binds a changed function by name
            if getattr(mod, "__name__", "").startswith("megatron_vlm"):
                for key, value in list(vars(mod).items()):
                    if _hashable(value) and value in olds:
                        self.swaps.append((mod, key, value, olds[value]))
        self.changed = sorted({f"{getattr(ns, '__name__', ns)}.{name}" for ns, name, _, _ in self.swaps})

    def _bind(self, which: int) -> None:
        for ns, name, *pair in self.swaps:
            setattr(ns, name, pair[which])

    def __enter__(self) -> OldCode:
        self._bind(1)
        return self

    def __exit__(self, *exc) -> None:
        self._bind(0)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return callable(value)
