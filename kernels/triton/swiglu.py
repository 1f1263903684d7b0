"""Triton SwiGLU: out = silu(gate) * up (forward + backward), elementwise over flat tensors.

silu(g) = g * sigmoid(g); with s = sigmoid(g): d silu / dg = s * (1 + g * (1 - s)), so
  d gate = dy * up * s * (1 + g (1 - s)),  d up = dy * silu(g).
Computed in fp32, stored in the input dtype. The backward recomputes sigmoid (one read of gate /
up instead of saving the activation).
"""
import torch
import triton
import triton.language as tl

from .common import check_device, direct_launch, to_dtype


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(DG + offs, to_dtype((dy * u * s * (1.0 + g * (1.0 - s))), DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, to_dtype((dy * silu), DU.dtype.element_ty), mask=mask)


def _block(t: torch.Tensor) -> int:
    return 4096 if t.device.type == "cpu" else 1024


def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = _block(gate)
        _swiglu_fwd_kernel[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block, num_warps=4)
    return y


@torch.library.custom_op("megatron_vlm::triton_swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _swiglu_fwd(gate, up)


@swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("megatron_vlm::triton_swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        block = _block(gate)
        _swiglu_bwd_kernel[(triton.cdiv(n, block),)](dy, gate, up, dg, du, n, BLOCK=block, num_warps=4)
    return dg, du


@swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd_op(dy, gate, up)


swiglu_op.register_autograd(_backward, setup_context=_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Public-signature SwiGLU on the Triton kernels."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate dtype {gate.dtype} != up dtype {up.dtype}")
    check_device("swiglu", gate, up)
    if direct_launch(gate, up):  # inference: no custom-op dispatch (common.direct_launch)
        return _swiglu_fwd(gate.contiguous(), up.contiguous())
    return swiglu_op(gate.contiguous(), up.contiguous())
