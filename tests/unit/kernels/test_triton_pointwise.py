"""Triton rms_norm (with fused residual), layer_norm, rotary and swiglu (compiled on CUDA, interpreted on CPU) against
the references: outputs and gradients, fp32 and bf16, awkward row counts (1, 7, 199) and widths.

The references were checked against transformers / torch in test_reference_ops.py. Both sides
compute in fp32 and round once, so the tolerances are a few fp32 ulps, and about one bf16 ulp.
"""
import pytest
import torch
from kernel_checks import DEVICE

from megatron_vlm.kernels import reference
from megatron_vlm.kernels.triton import layer_norm as t_layer_norm
from megatron_vlm.kernels.triton import rms_norm as t_rms_norm
from megatron_vlm.kernels.triton import rotary as t_rotary
from megatron_vlm.kernels.triton import swiglu as t_swiglu

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1 / 128)}
DTYPES = [torch.float32, torch.bfloat16]


def _compare(fn_got, fn_ref, inputs, dtype, n_outputs=1):
    """Run both functions on copies of inputs, compare outputs and gradients w.r.t. every input."""
    gen = torch.Generator().manual_seed(123)
    got_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    got, ref = fn_got(*got_in), fn_ref(*ref_in)
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(got) == len(ref) == n_outputs
    upstream = [torch.randn(r.shape, generator=gen).to(r) for r in ref]
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g.float(), r.float(), **TOL[dtype])
    diff_in = [i for i, t in enumerate(inputs) if t.is_floating_point()]
    g_grads = torch.autograd.grad(got, [got_in[i] for i in diff_in], upstream, allow_unused=True)
    r_grads = torch.autograd.grad(ref, [ref_in[i] for i in diff_in], upstream, allow_unused=True)
    for i, gg, rg in zip(diff_in, g_grads, r_grads):
        if rg is None:
            assert gg is None or gg.abs().max() == 0, f"input {i}: unexpected gradient"
            continue
        assert gg is not None, f"input {i}: missing gradient"
        torch.testing.assert_close(gg.float(), rg.float(), **TOL[dtype], msg=lambda m: f"grad of input {i}: {m}")


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 80), (199, 48)])
def test_rms_norm(rows, hidden, dtype):
    x, w = _rand(rows, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=1)
    _compare(lambda a, b: t_rms_norm.rms_norm(a, b, 1e-6), lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype):
    x, r, w = _rand(3, 7, 80, dtype=dtype), _rand(3, 7, 80, dtype=dtype, seed=2), _rand(80, dtype=dtype, seed=1)
    _compare(
        lambda a, b, c: t_rms_norm.rms_norm(a, c, 1e-5, residual=b),
        lambda a, b, c: reference.rms_norm(a, c, 1e-5, residual=b),
        [x, r, w], dtype, n_outputs=2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 80), (199, 48)])
def test_layer_norm(rows, hidden, dtype):
    x, w, b = _rand(rows, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=1), _rand(hidden, dtype=dtype, seed=2)
    _compare(lambda *a: t_layer_norm.layer_norm(*a, 1e-6), lambda *a: reference.layer_norm(*a, 1e-6), [x, w, b], dtype)


def test_layer_norm_without_affine():
    x = _rand(7, 80, dtype=torch.float32)
    _compare(lambda a: t_layer_norm.layer_norm(a, None, None, 1e-6), lambda a: reference.layer_norm(a, None, None, 1e-6), [x], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "x_shape,cos_shape,interleaved,rotary_dim",
    [
        ((2, 7, 3, 80), (7, 80), False, None),  # [B, S, H, D], cos shared over the batch
        ((2, 7, 3, 64), (2, 7, 64), False, None),  # per-sample cos (M-RoPE style)
        ((199, 2, 80), (199, 80), True, None),  # packed vision tokens, interleaved
        ((1, 4, 80), (1, 24), False, 48),  # one token, half-width cos, partial rotary (tail passes)
        ((7, 2, 64), (7, 32), True, None),  # full-width partial interleaved
    ],
)
def test_rotary(x_shape, cos_shape, interleaved, rotary_dim, dtype):
    x = _rand(*x_shape, dtype=dtype)
    angles = _rand(*cos_shape, dtype=torch.float32, seed=5)
    cos, sin = angles.cos(), angles.sin()
    _compare(
        lambda a: t_rotary.apply_rotary(a, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim),
        lambda a: reference.apply_rotary(a, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim),
        [x], dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 80), (3, 199, 11)])
def test_swiglu(shape, dtype):
    g, u = _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype, seed=1)
    _compare(t_swiglu.swiglu, reference.swiglu, [g * 3, u], dtype)
