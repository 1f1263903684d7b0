"""Ascend adapter for `swiglu` on `torch_npu.npu_swiglu(input, dim)`.

npu_swiglu splits `input` in two halves A, B along `dim` and returns silu(A) * B; our API takes
gate (= A) and up (= B) separately, so they are concatenated on the last dim first (one copy; a
model holding a fused gate_up projection output can pass its halves as views to avoid nothing
more than that copy).
"""
import torch

from ._torch_npu import torch_npu_module


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Public-signature SwiGLU on torch_npu."""
    torch_npu = torch_npu_module("swiglu")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("swiglu: needs at least 1-D tensors")
    return torch_npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
