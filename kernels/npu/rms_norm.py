"""Ascend adapter for `rms_norm` on `torch_npu.npu_rms_norm` / `npu_add_rms_norm`.

npu_rms_norm(x, gamma, epsilon) -> (y, rstd); npu_add_rms_norm(x1, x2, gamma, epsilon) ->
(y, rstd, x1 + x2), the fused residual add (the normalised input is the sum, as in our contract).
gamma must have x's dtype on the device, so the weight is cast to it.

npu_add_rms_norm has no derivative (torch_npu registers torch's not-implemented autograd fallback for it:
a backward through its outputs raises), so it is taken only when no gradient is needed (inference, rollouts);
a training forward adds in torch and normalises with npu_rms_norm, which has a backward.
"""
from typing import Optional, Union

import torch

from ._torch_npu import torch_npu_module


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Public-signature RMSNorm on torch_npu's fused kernels."""
    torch_npu = torch_npu_module("rms_norm")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    gamma = weight.to(x.dtype)
    if residual is None:
        return torch_npu.npu_rms_norm(x, gamma, epsilon=float(eps))[0]
    if residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    residual = residual.to(x.dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, gamma)):
        summed = x + residual
        return torch_npu.npu_rms_norm(summed, gamma, epsilon=float(eps))[0], summed
    y, _, summed = torch_npu.npu_add_rms_norm(x, residual, gamma, float(eps))
    return y, summed
