"""LayerNorm on torch's fused kernel (`F.layer_norm`), the `torch_fused` backend of `layer_norm`.

Why: on an H100 (bf16, InternViT 32 tiles x 1025 x 1024) our Triton layer_norm took 1.47x / 1.03x the time of
F.layer_norm (fwd / bwd; bench_rms_norm, benchmarks/RESULTS.md, 2026-11-26), so `auto` takes this on CUDA.
Numerics match the reference (`kernels/reference/norms.py`) when the weight and bias are in x's dtype (as
training holds them): statistics and the affine transform in fp32, one rounding to x's dtype at the end (torch's
CUDA kernel accumulates in fp32 for half inputs). Parameters of another dtype are cast to x's first (fp32
parameters with bf16 x: rounded to bf16, where the reference multiplies in fp32). The torch backend stays the
reference: a chain of eager ops that reads the activation several times. `auto` takes this on CUDA only (the
measured device); forced, it runs on any device.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference.norms import _check_weight

__all__ = ["layer_norm"]


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Public signature of `kernels.layer_norm` (contract: kernels/reference/norms.py)."""
    _check_weight("layer_norm", x, weight, "weight")
    _check_weight("layer_norm", x, bias, "bias")

    def same(t):  # parameters in x's dtype, which every device's kernel takes (bf16 training holds them so anyway)
        return t if t is None or t.dtype == x.dtype else t.to(x.dtype)

    return F.layer_norm(x, (x.shape[-1],), same(weight), same(bias), eps)
