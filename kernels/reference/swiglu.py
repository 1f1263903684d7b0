"""Reference SwiGLU: silu(gate) * up, computed in fp32 and returned in the input dtype."""
import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shaped tensors (the gated MLP of Qwen / InternVL / Llama)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
