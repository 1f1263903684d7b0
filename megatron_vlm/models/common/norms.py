"""RMSNorm module over the last dimension, computed by `megatron_vlm.kernels.rms_norm`.

The weight starts at ones (as in transformers); `eps` comes from the config (`rms_norm_eps`) or
the family's fixed value (1e-6 in the Qwen vision towers).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_vlm import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
