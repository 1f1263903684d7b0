"""Feed-forward blocks.

* `SwiGLUMLP`, gated SiLU: down_proj(silu(gate_proj(x)) * up_proj(x)). Used by the Qwen2 / Qwen2.5-VL /
  Qwen3 decoders (no bias) and the Qwen2.5-VL vision blocks (with bias). gate and up stay separate
  Linear layers so that tensor parallelism can shard both column-wise; the activation product runs
  in `megatron_vlm.kernels.swiglu`.
* `MLP`, plain two-layer: fc2(act(fc1(x))), the ViT feed-forward of the Qwen3-VL vision tower
  (`gelu_pytorch_tanh`) and InternViT (`gelu`). `activation` takes the transformers `hidden_act`
  names listed in `ACTIVATIONS`; any other name is an error.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, transformers' "gelu"
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; known: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class MLP(nn.Module):
    """fc2(act(fc1(x))) with biases (ViT feed-forward)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str, bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)
        self.fc1 = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
