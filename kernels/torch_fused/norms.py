"""LayerNorm on torch's fused kernel (`F.layer_norm`), the `torch_fused` backend of `layer_norm`.

Why: on an H100 (bf16, InternViT 32 tiles x 1025 x 1024) our Triton layer_norm took 1.47x / 1.03x the time of
F.layer_norm (fwd / bwd; bench_rms_norm, benchmarks/RESULTS.md, 2026-11-26), so `auto` takes this on CUDA.
Numerics match the reference (`kernels/reference/norms.py`): statistics and the affine transform in fp32,
one rounding to x's dtype at the end (torch's CUDA kernel accumulates in fp32 for half inputs). The torch
backend stays the reference: it is a chain of eager ops that reads the activation several times.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference.norms import _check_weight

__all__ = ["layer_norm", "cuda_check"]


def cuda_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Registry check: chosen on CUDA only (the measured device); forced elsewhere it still runs."""
    if device_type != "cuda":
        return f"tensor on {device_type}; chosen only on cuda (the measured device)"
    return None


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Public signature of `kernels.layer_norm` (contract: kernels/reference/norms.py)."""
    _check_weight("layer_norm", x, weight, "weight")
    _check_weight("layer_norm", x, bias, "bias")

    def same(t):  # parameters in x's dtype, which every device's kernel takes (bf16 training holds them so anyway)
        return t if t is None or t.dtype == x.dtype else t.to(x.dtype)

    return F.layer_norm(x, (x.shape[-1],), same(weight), same(bias), eps)
