"""Gated SiLU MLP (SwiGLU): down_proj(silu(gate_proj(x)) * up_proj(x)).

Used by the Qwen2 / Qwen2.5-VL decoders (no bias) and the Qwen2.5-VL vision blocks (with bias).
gate and up stay separate Linear layers so that tensor parallelism can shard both column-wise;
the activation product runs in `megatron_vlm.kernels.swiglu`.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_vlm import kernels


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
