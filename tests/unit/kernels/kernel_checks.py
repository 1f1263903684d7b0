"""Shared helpers of the kernel tests: the device the Triton kernels run on, cu_seqlens builders,
error measures, the 2x-of-reference rule."""
import os
from collections.abc import Sequence

import torch

# Triton kernels run compiled on CUDA, or in the interpreter on CPU (tests/conftest.py sets
# TRITON_INTERPRET=1 exactly when there is no CUDA device). Tests build their inputs on CPU (seeded
# generators) and move them here.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def cu_seqlens(lengths: Sequence[int], device: str = "cpu") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_2x(name: str, got: torch.Tensor, exact: torch.Tensor, naive_lowp: torch.Tensor, floor: float) -> None:
    """err(got vs fp64 truth) <= 2 * err(naive low-precision reference vs truth) + floor.

    A low-precision kernel cannot match an fp64 truth to fixed tolerances (the error grows with the
    reduction length and the dtype); the naive reference computed in the kernel's precision shows
    what that precision allows, so the kernel passes when it is no worse than twice that (plus a
    small absolute floor for results that are exact in both)."""
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, base = max_err(got, exact), max_err(naive_lowp, exact)
    assert err <= 2 * base + floor, f"{name}: error {err:.3g} > 2 x reference error {base:.3g} + {floor:g}"


def tolerance(dtype: torch.dtype) -> dict:
    """Per-dtype tolerances for the memory-bound ops (one rounding of the output, interpreter truncation)."""
    return {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]
