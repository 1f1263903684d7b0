"""Availability checks: can a backend run an op for a tensor of this device type and dtype?

A check returns None when the backend can run (a backend registered without a check can always run), or the reason it cannot (shown in
`BackendUnavailableError` when the backend is forced). Checks look at what is installed and at the
environment, so the registry calls each one once per (op, backend, device type, dtype) and caches
the answer (`KernelRegistry.clear_cache()` after changing the environment).
"""
import importlib.util
import os
import sys
from typing import Callable, Optional, Tuple

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


def cuda_package_check(package: str, dtypes: Tuple[torch.dtype, ...] = ()) -> Check:
    """Check for a third-party CUDA package (flash_attn, liger_kernel ...), optionally limited to dtypes."""

    def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
        if not _module_installed(package):
            return f"{package} is not installed"
        if device_type != "cuda":
            return f"tensor on {device_type}; {package} needs a cuda tensor"
        if dtypes and dtype not in dtypes:
            return f"{package} does not support {dtype} (needs one of {', '.join(str(d) for d in dtypes)})"
        return None

    return check


def triton_package_check(package: str) -> Check:
    """For a third-party package of Triton kernels (liger_kernel ...): installed, and triton can run here."""

    def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
        if not _module_installed(package):
            return f"{package} is not installed"
        return triton_check(device_type, dtype)

    return check
