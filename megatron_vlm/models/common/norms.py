"""Norm modules over the last dimension: `RMSNorm` (`megatron_vlm.kernels.rms_norm`) and
`LayerNorm` (`megatron_vlm.kernels.layer_norm`; weight and bias, as `nn.LayerNorm`).

Weights start at ones and biases at zeros (as in transformers); `eps` comes from the config
(`rms_norm_eps`, `layer_norm_eps`) or the family's fixed value (1e-6 in the Qwen vision towers,
PyTorch's 1e-5 in the InternVL projector). Parameter names (`weight`, `bias`) match `nn.LayerNorm`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """rms_norm(x); with `residual`, the fused (rms_norm(x + residual), x + residual)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm with affine weight and (optional) bias; used by the Qwen3-VL and InternViT vision towers."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
