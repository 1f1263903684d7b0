"""Availability checks: can a backend run an op for a tensor of this device type and dtype?

A check returns None when the backend can run (a backend registered without a check can always run), or the reason it cannot (shown in
`BackendUnavailableError` when the backend is forced). Checks look at what is installed and at the
environment, so the registry calls each one once per (op, backend, device type, dtype) and caches
the answer (`KernelRegistry.clear_cache()` after changing the environment).
"""
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Optional

import torch

# Gets the device type and dtype of the op's first tensor argument; None = usable, else the reason.
Check = Callable[[str, torch.dtype], Optional[str]]


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return name in sys.modules


def triton_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Triton kernels run on CUDA, or on CPU through the interpreter (TRITON_INTERPRET=1 before import)."""
    if not _module_installed("triton"):
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
            return "tensor on cpu and TRITON_INTERPRET is not set"
        return None
    return f"tensor on {device_type}; triton needs cuda (or cpu with TRITON_INTERPRET=1)"


def npu_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    if not _module_installed("torch_npu"):
        return "torch_npu is not installed"
    if device_type != "npu":
        return f"tensor on {device_type}; the npu backend needs an npu tensor"
    return None


def import_error(module: str) -> Optional[str]:
    """None if `module` imports here, else why not. Why a real import and not only `find_spec`: a compiled
    package built against another torch or CUDA (flash-attn, causal-conv1d, mamba-ssm, TE after a torch
    upgrade: "undefined symbol ...") is installed but cannot load; `auto` must pass over it with that
    reason, not pick it and fail at the model's first call. Import failures are not cached by Python, but
    the registry caches each check's answer."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, OSError from a shared library, a package's own RuntimeError
        return f"{type(e).__name__}: {e}"
    return None


def cuda_package_check(package: str, dtypes: tuple[torch.dtype, ...] = (), modules: tuple[str, ...] = ()) -> Check:
    """Check for a third-party CUDA package (flash_attn, liger_kernel ...), optionally limited to dtypes.

    `modules`: what the adapter imports (default: the package itself); imported on CUDA only, after the
    device and dtype checks, so a CPU run never loads a GPU package."""

    def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
        if not _module_installed(package):
            return f"{package} is not installed"
        if device_type != "cuda":
            return f"tensor on {device_type}; {package} needs a cuda tensor"
        if dtypes and dtype not in dtypes:
            return f"{package} does not support {dtype} (needs one of {', '.join(str(d) for d in dtypes)})"
        return _modules_error(package, modules)

    return check


def _modules_error(package: str, modules: tuple[str, ...]) -> Optional[str]:
    """Why the first of `modules` (default: the package) that does not import fails, or None."""
    for module in modules or (package,):
        error = import_error(module)
        if error is not None:
            return f"{package} is installed but {module} does not import ({error})"
    return None


def triton_package_check(package: str, modules: tuple[str, ...] = ()) -> Check:
    """For a third-party package of Triton kernels (liger_kernel ...): installed, triton can run here, and
    `modules` (default: the package) import."""

    def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
        if not _module_installed(package):
            return f"{package} is not installed"
        reason = triton_check(device_type, dtype)
        return reason if reason is not None else _modules_error(package, modules)

    return check
