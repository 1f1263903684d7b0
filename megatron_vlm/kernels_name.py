"""Leave the top-level name `kernels` to an installed package of that name (Hugging Face's `kernels`).

Why: the op library lives in the checkout's `kernels/` folder (imported as `megatron_vlm.kernels`). Wherever the
checkout's root is on `sys.path` (the launchers put it first, so that a run uses its own checkout; pytest's
`pythonpath`; `PYTHONPATH=$PWD`; `python -c` in the root), that folder also answers `import kernels`. transformers
imports `kernels` when a distribution of that name is installed, and then failed at every model import with
"cannot import name 'CUDAProperties' from 'kernels' (<checkout>/kernels/__init__.py)". Importing the installed
package first, with the root out of the search path for that one import, binds the name to it for the process;
every process that imports this package does so (launchers, DataLoader workers, reward workers).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
"""The folder that holds this package and, in a checkout, the op library's `kernels/` folder."""


def _is_root(entry: str) -> bool:
    try:
        return Path(os.path.abspath(entry or os.curdir)).resolve() == CHECKOUT_ROOT
    except OSError:
        return False


def shadows_installed_kernels() -> bool:
    """Whether `import kernels` would now load the checkout's `kernels/` folder while a distribution named
    `kernels` is installed."""
    if "kernels" in sys.modules:
        return False
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent.parent != CHECKOUT_ROOT:
        return False
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def bind_installed_kernels() -> None:
    """Import the installed `kernels` package under its name when the checkout's folder would shadow it."""
    if not shadows_installed_kernels():
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not _is_root(p)]
    importlib.invalidate_caches()
    try:
        importlib.import_module("kernels")
    except ImportError:  # a distribution's metadata without an importable package: nothing to bind
        sys.modules.pop("kernels", None)
    finally:
        sys.path[:] = saved
