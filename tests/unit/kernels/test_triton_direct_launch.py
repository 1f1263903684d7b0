"""Inference calls of the Triton rms_norm / swiglu / apply_rotary wrappers launch their kernels directly (no
custom-op dispatch: kernels/triton/common.py `direct_launch`); calls that autograd must record still go through
the custom ops. Both paths give bitwise the same outputs (compiled on CUDA, interpreted on CPU)."""
import torch
from kernel_checks import DEVICE

from megatron_vlm.kernels.triton import rms_norm as T_norm
from megatron_vlm.kernels.triton import rotary as T_rot
from megatron_vlm.kernels.triton import swiglu as T_swiglu
from megatron_vlm.kernels.triton.common import direct_launch


def _refuse(monkeypatch, module, name):
    def boom(*a, **k):
        raise AssertionError(f"{name}: custom op called on the direct path")

    monkeypatch.setattr(module, name, boom)


def _cases(g):
    x = torch.randn(5, 3, 32, generator=g).to(DEVICE)
    w = torch.randn(32, generator=g).to(DEVICE)
    r = torch.randn(5, 3, 32, generator=g).to(DEVICE)
    gate, up = torch.randn(7, 48, generator=g).to(DEVICE), torch.randn(7, 48, generator=g).to(DEVICE)
    q = torch.randn(2, 6, 4, 16, generator=g).to(DEVICE)
    cos, sin = torch.randn(6, 16, generator=g).to(DEVICE), torch.randn(6, 16, generator=g).to(DEVICE)
    return {
        "rms_norm": lambda: T_norm.rms_norm(x, w, 1e-6),
        "rms_norm_residual": lambda: T_norm.rms_norm(x, w, 1e-6, residual=r),
        "swiglu": lambda: T_swiglu.swiglu(gate, up),
        "apply_rotary": lambda: T_rot.apply_rotary(q, cos, sin),
    }


def test_direct_path_equals_custom_op_path(monkeypatch):
    cases = _cases(torch.Generator().manual_seed(0))
    with torch.enable_grad():  # leaves without requires_grad: direct
        direct = {k: f() for k, f in cases.items()}
    with monkeypatch.context() as m:  # the custom-op path, forced
        m.setattr(T_norm, "direct_launch", lambda *t: False)
        m.setattr(T_swiglu, "direct_launch", lambda *t: False)
        m.setattr(T_rot, "direct_launch", lambda *t: False)
        via_op = {k: f() for k, f in cases.items()}
    for k in cases:
        a, b = direct[k], via_op[k]
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), k


def test_inference_calls_skip_the_custom_ops(monkeypatch):
    for module, names in ((T_norm, ("rms_norm_fwd_op", "rms_norm_residual_fwd_op")), (T_swiglu, ("swiglu_op",)),
                          (T_rot, ("rotary_op",))):
        for name in names:
            _refuse(monkeypatch, module, name)
    cases = _cases(torch.Generator().manual_seed(1))
    with torch.no_grad():
        for f in cases.values():
            f()


def test_calls_autograd_records_keep_the_custom_ops():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(32, generator=g).to(DEVICE)
    assert not direct_launch(x, w) and direct_launch(x.detach(), w, None)
    with torch.no_grad():
        assert direct_launch(x, w)
    y = T_norm.rms_norm(x, w, 1e-6)
    assert y.grad_fn is not None  # recorded through the custom op's autograd
    (gx,) = torch.autograd.grad(y.sum(), (x,))
    assert gx.shape == x.shape and torch.isfinite(gx).all()


def test_a_compile_trace_keeps_the_custom_ops(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not direct_launch(torch.zeros(2))


def test_rotary_reads_row_strided_heads_in_place():
    """The q and k heads of a fused q / k / v output (a row-strided view) rotate as their contiguous copy does."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 1, 4 + 2 + 2, 16, generator=g).to(DEVICE)  # [B, T, q 4 | k 2 | v 2 heads, D]
    cos, sin = torch.randn(3, 1, 16, generator=g).to(DEVICE), torch.randn(3, 1, 16, generator=g).to(DEVICE)
    qk = qkv[..., :6, :]
    assert not qk.is_contiguous()
    with torch.no_grad():
        assert torch.equal(T_rot.apply_rotary(qk, cos, sin), T_rot.apply_rotary(qk.contiguous(), cos, sin))


def test_rotary_output_is_contiguous_for_permuted_heads():
    """A dense x whose heads and tokens are permuted ([1, H, T, D] transposed: its rows fold into a view) gives a
    contiguous output, as `_launch` says, and the values of its contiguous copy."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 6, 16, generator=g).to(DEVICE).transpose(1, 2)  # [1, T 6, H 4, D]
    cos, sin = torch.randn(1, 6, 16, generator=g).to(DEVICE), torch.randn(1, 6, 16, generator=g).to(DEVICE)
    with torch.no_grad():
        y = T_rot.apply_rotary(x, cos, sin)
        assert y.is_contiguous()
        assert torch.equal(y, T_rot.apply_rotary(x.contiguous(), cos, sin))
