"""mamba-ssm's Mamba-2 Triton kernels without the rest of the package, for the tests of our adapter.

Why: `import mamba_ssm.ops.triton.ssd_combined` first runs `mamba_ssm/__init__.py`, which imports the
Mamba-1 CUDA extension `selective_scan_cuda` (and the Mamba-1 / Mamba-3 modules). The kernels our adapter
(`kernels/thirdparty/mamba_ssm.py`) calls — `mamba_chunk_scan_combined` and `selective_state_update` — are
Triton only and need none of that. An install built without its CUDA sources (MAMBA_SKIP_CUDA_BUILD=TRUE,
as the README's test install does, and a wheel small enough to carry to a GPU machine) has them but cannot
import the package. `triton_only_package()` registers `mamba_ssm` as a bare package (its submodules are
found on its path, its `__init__` is not run) for the duration of a block, so that those modules import
and the real kernel code runs: compiled on a GPU, in Triton's interpreter on the CPU.

It changes nothing of what the kernels compute. The production adapter imports the package normally; on
an install that cannot, `auto` passes the backend over with the import error as the reason
(`kernels/availability.py`).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

__all__ = ["triton_only_package", "triton_modules", "installed"]


def installed() -> bool:
    """mamba-ssm is installed (found on the path; nothing is imported)."""
    return importlib.util.find_spec("mamba_ssm") is not None


def _ours(name: str) -> bool:
    return name == "mamba_ssm" or name.startswith("mamba_ssm.")


@contextlib.contextmanager
def triton_only_package() -> Iterator[types.ModuleType]:
    """Inside the block `mamba_ssm.ops.triton.*` import without `mamba_ssm/__init__.py`; afterwards every
    `mamba_ssm` module imported inside is forgotten and what `sys.modules` held before comes back."""
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("mamba_ssm is not installed (see the README's install section)")
    saved = {name: sys.modules.pop(name) for name in [n for n in sys.modules if _ours(n)]}
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    sys.modules["mamba_ssm"] = package
    try:
        yield package
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def triton_modules() -> Iterator[None]:
    """Inside the block `mamba_ssm.ops.triton.*` import: as they are from a full install, else through
    `triton_only_package` (an install without the CUDA extension)."""
    try:
        importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError:
        with triton_only_package():
            yield
        return
    yield
