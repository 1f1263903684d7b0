"""Whether a worker started by the worker server runs the entry script again, and the error when it would have to.

Why: a worker started by the worker server (worker_start.py), like one started by `spawn`, is no copy of the rank,
so multiprocessing runs the rank's entry script again in it (as `__mp_main__`) for the classes a pickle names in
`__main__`. Run again, a script whose code sits under `if __name__ == "__main__":` only imports and defines; an
unguarded one runs its training code again in every worker (a process group joined, a model built) up to its own
loader, where the worker dies (a pickle of the script's own class would need that run). So:

- the code now running in the script (the top-level statement that led to the loader) is under such a guard: the
  workers run the script again, as `spawn` does (its imports and definitions are theirs, its classes unpickle);
- it is not: the workers start without the script (`without_main_context`), which works whenever the pickle names
  nothing in `__main__`; a pickle that does is `MainModuleError` at loader creation, saying to move the class into a
  module or guard the script. The same error comes where the entry point is no file to run again (an interactive
  session, `python -c`, a package's `__main__`).
"""
from __future__ import annotations

import ast
import functools
import os
import sys
import threading
from multiprocessing import context as mp_context
from multiprocessing import spawn
from types import FrameType, ModuleType
from typing import Optional

__all__ = ["MainModuleError", "main_script_runs_again", "check_main_names", "without_main_context"]


class MainModuleError(RuntimeError):
    """The workers' pickle names a class of the entry script that they cannot import (module docstring)."""


def _rerun_path(main: ModuleType) -> Optional[str]:
    """The file multiprocessing would run again in a worker for `main` (its rule in `spawn.prepare`), or None."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None  # `python -m package`: never run again
    path = getattr(main, "__file__", None)
    if not path or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str, _mtime: float) -> tuple[tuple[int, int], ...]:
    """The line spans of the bodies of `if __name__ == "__main__":` in the script at `path`."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            spans.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return tuple(spans)


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _top_level_frame(main: ModuleType) -> Optional[FrameType]:
    """The frame running `main`'s top level: in this thread's stack, else the main thread's."""
    stacks = [sys._getframe(), sys._current_frames().get(threading.main_thread().ident or -1)]
    for frame in stacks:
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
                return frame
            frame = frame.f_back
    return None


def main_script_runs_again() -> bool:
    """Whether the workers may run the entry script again: it is a file whose code now running is under
    `if __name__ == "__main__":` (where it no longer runs, whether it has such a guard at all)."""
    main = sys.modules["__main__"]
    path = _rerun_path(main)
    if path is None:
        return False
    try:
        spans = _guarded_lines(path, os.path.getmtime(path))
    except (OSError, SyntaxError, ValueError):
        return False  # cannot read it: do not run it again
    frame = _top_level_frame(main)
    if frame is None:
        return bool(spans)
    return any(a <= frame.f_lineno <= b for a, b in spans)


def check_main_names(names: list[str], what: str, runs_again: bool) -> None:
    """Raise `MainModuleError` when `what`'s pickle names classes or functions of `__main__` (`names`) that the
    workers cannot import: the entry script is not run again in them."""
    if not names or runs_again:
        return
    main = sys.modules["__main__"]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if _rerun_path(main) is None:
        where = ("the entry point is no script file that a worker could import (an interactive session, python -c, "
                 "a package's __main__)")
        fix = "Move it into a module that the entry point imports"
    else:
        where = (f"the script {getattr(main, '__file__', '?')} runs code outside `if __name__ == \"__main__\":`, "
                 "which a worker would run again to import it")
        fix = 'Move it into a module that the script imports, or put the script\'s code under `if __name__ == "__main__":`'
    raise MainModuleError(
        f"data.num_workers > 0: the DataLoader workers start from a worker server and receive {what} pickled, which "
        f"refers to {shown} of the entry script; {where}. {fix}, or set data.num_workers = 0 to read the data in the "
        "training process")


_launching = threading.local()
_lock = threading.Lock()


def _leave_out_main_while_launching() -> None:
    """Wrap (once) multiprocessing's preparation data, the state a new process sets up before unpickling its target,
    to leave out the entry script while this thread starts a worker that must not run it again. A wrap, not a copy of
    the fork server's launch code: that code changes between Python versions, this function's contract does not."""
    with _lock:
        original = spawn.get_preparation_data
        if getattr(original, "_leaves_out_main", False):
            return

        def preparation_data(name: str) -> dict:
            data = original(name)
            if getattr(_launching, "without_main", False):
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
            return data

        preparation_data._leaves_out_main = True  # type: ignore[attr-defined]
        spawn.get_preparation_data = preparation_data


try:
    from multiprocessing import popen_forkserver
except ImportError:  # no fork server on this platform (worker_start.py then uses the platform default)
    popen_forkserver = None  # type: ignore[assignment]


if popen_forkserver is not None:
    class _WithoutMainPopen(popen_forkserver.Popen):
        def _launch(self, process_obj):
            _leave_out_main_while_launching()
            _launching.without_main = True
            try:
                super()._launch(process_obj)
            finally:
                _launching.without_main = False

    class _WithoutMainProcess(mp_context.ForkServerProcess):
        @staticmethod
        def _Popen(process_obj):
            return _WithoutMainPopen(process_obj)

    class _WithoutMainContext(mp_context.ForkServerContext):
        Process = _WithoutMainProcess


def without_main_context() -> mp_context.BaseContext:
    """The fork server's context, whose workers start without running the entry script again."""
    return _WithoutMainContext()
