"""torch.compile traces through the Triton custom ops (fake tensors + registered autograd): a
fullgraph compile with the aot_eager backend (no inductor codegen, fast on CPU) gives the same
outputs and gradients as eager; torch.library.opcheck validates the registrations. Inputs live on
`kernel_checks.DEVICE` (compiled kernels on CUDA, interpreted on CPU)."""
import torch
from kernel_checks import DEVICE, cu_seqlens

from megatron_vlm.kernels.triton import attention as t_attention
from megatron_vlm.kernels.triton import layer_norm as t_layer_norm
from megatron_vlm.kernels.triton import rms_norm as t_rms_norm
from megatron_vlm.kernels.triton import rotary as t_rotary
from megatron_vlm.kernels.triton import swiglu as t_swiglu
from megatron_vlm.kernels.triton import token_logprobs as t_logprobs


def _block(x, w, b, gate_w, cos, sin, cu):
    """A tiny transformer-ish block that exercises every op's custom op in one graph."""
    h, summed = t_rms_norm.rms_norm(x, w, 1e-6, residual=x * 0.5)
    h = t_layer_norm.layer_norm(h, w, b, 1e-5)
    q = t_rotary.apply_rotary(h.view(h.shape[0], 2, 16), cos, sin)
    o = t_attention.attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    o = o.reshape(h.shape[0], 32)
    return t_swiglu.swiglu(o @ gate_w, o) + summed


def _leaf(g, *shape):
    return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()


def test_compiled_block_matches_eager_forward_and_backward():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, w, b, gate_w = (_leaf(g, *shape) for shape in ((11, 32), (32,), (32,), (32, 32)))
    angles = torch.randn(11, 16, generator=g).to(DEVICE)
    args = (x, w, b, gate_w, angles.cos(), angles.sin(), cu_seqlens([4, 7], DEVICE))
    eager = _block(*args)
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager)
    up = torch.randn_like(eager)
    leaves = (x, w, b, gate_w)
    for a, e in zip(torch.autograd.grad(compiled, leaves, up), torch.autograd.grad(eager, leaves, up)):
        torch.testing.assert_close(a, e)


def test_compiled_token_logprobs_op_matches_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    hidden, weight = _leaf(g, 6, 16), _leaf(g, 300, 16)
    labels = torch.tensor([3, -100, 299, 0, 7, 8], device=DEVICE)

    def fn(h, w):
        logp, ent, _ = t_logprobs.token_logprobs_fwd_op(h, w, labels, 0.9, 4, True)
        return (logp * 2).sum() + ent.sum()

    eager, compiled = fn(hidden, weight), torch.compile(fn, backend="aot_eager", fullgraph=True)(hidden, weight)
    torch.testing.assert_close(compiled, eager)
    for a, e in zip(torch.autograd.grad(compiled, (hidden, weight)), torch.autograd.grad(eager, (hidden, weight))):
        torch.testing.assert_close(a, e)


def test_opcheck_custom_op_registrations():
    g = torch.Generator().manual_seed(2)
    gate, up = _leaf(g, 3, 20), _leaf(g, 3, 20)
    torch.library.opcheck(t_swiglu.swiglu_op, (gate, up))
    x, w, r = _leaf(g, 5, 24), _leaf(g, 24), _leaf(g, 5, 24)
    torch.library.opcheck(t_rms_norm.rms_norm_residual_fwd_op, (x, r, w, 1e-6))
    cos, sin = torch.randn(1, 5, 16, generator=g).to(DEVICE), torch.randn(1, 5, 16, generator=g).to(DEVICE)
    torch.library.opcheck(t_rotary.rotary_op, (_leaf(g, 5, 2, 16), cos, sin, False))
