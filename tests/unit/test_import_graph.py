"""The package's imports form no cycle, counting the imports inside functions.

A cycle hidden by moving one import into a function still couples the two modules: each needs the other to
work, and the cycle comes back as soon as somebody moves the import up. So this test walks every import
statement of every module in `megatron_vlm/` and `kernels/` (imported as `megatron_vlm.kernels`), at module
level and inside functions and methods alike; only imports under `if TYPE_CHECKING:` (annotations, never run)
and imports of optional third-party packages (they are not in the graph) are left out. It fails on any
strongly connected component of more than one module, and on any cycle between the top-level sub-packages.

Importing `a.b.c` also imports the packages `a.b` and `a`, so those edges count too, except towards the
packages that contain the importing module itself: they are initialised before the module runs, whatever it
imports (a module importing a sibling `from .registry import X` does not depend on its package's
`__init__`). Importing a name from an enclosing package (`from .. import moe_permute`) does, and counts.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    mods = {}
    for base, prefix in (("megatron_vlm", ()), ("kernels", ("megatron_vlm",))):
        for path in (ROOT / base).rglob("*.py"):
            parts = prefix + path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(tree: ast.Module):
    """Every import node of the module, wherever it stands (module level, functions, methods, classes), except
    those under `if TYPE_CHECKING:`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1 + is_pkg)}  # enclosing packages
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                    q = ".".join(parts[:i])
                    if q in mods and q != mod and (q == t or q not in own):
                        graph[mod].add(q)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one node (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _subpackage(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_no_module_import_cycle():
    cycles = strongly_connected(import_graph())
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_cycle_between_subpackages():
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = _subpackage(mod)
        packages.setdefault(a, set())
        for d in deps:
            b = _subpackage(d)
            if a != b and b != "megatron_vlm" and a != "megatron_vlm":
                packages[a].add(b)
    cycles = strongly_connected(packages)
    assert not cycles, "sub-packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walker_sees_a_cycle(tmp_path):
    """The detector itself: a two-node cycle is found, a chain is not."""
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_walker_sees_function_local_imports():
    """An import inside a function or method counts (a cycle hidden there is still a cycle); one under
    `if TYPE_CHECKING:` does not."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import annotations_only\n"
        "def f():\n    import in_function\n"
        "class C:\n    def m(self):\n        from in_method import x\n"
    )
    seen = {a.name for n in _imports(tree) if isinstance(n, ast.Import) for a in n.names}
    seen |= {n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)}
    assert seen == {"typing", "in_function", "in_method"}
