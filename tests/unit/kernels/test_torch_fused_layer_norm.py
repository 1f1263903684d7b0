"""The `torch_fused` layer_norm backend (F.layer_norm; `auto` on CUDA) against the reference: values and
gradients in fp32, bf16 within one rounding, optional weight / bias, the reference's shape checks."""
import pytest
import torch

from megatron_vlm.kernels.reference.norms import layer_norm as reference
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY
from megatron_vlm.kernels.torch_fused.norms import layer_norm


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_fp32_values_and_gradients_match_the_reference(affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 48, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(48, generator=g) + 1).requires_grad_() if affine != "none" else None
    b = torch.randn(48, generator=g).requires_grad_() if affine == "both" else None
    out = layer_norm(x, w, b, 1e-5)
    ref = reference(x.double(), None if w is None else w.double(), None if b is None else b.double(), 1e-5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    params = [t for t in (x, w, b) if t is not None]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(reference(x, w, b, 1e-5), params, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-4)


def test_bf16_within_one_rounding_of_the_fp32_result():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g).bfloat16()
    w, b = (torch.randn(96, generator=g) + 1).bfloat16(), torch.randn(96, generator=g).bfloat16()
    out = layer_norm(x, w, b, 1e-6)
    assert out.dtype == torch.bfloat16
    exact = reference(x.float(), w.float(), b.float(), 1e-6)
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=1.6e-2)


def test_bad_weight_shape_is_refused_like_the_reference():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="does not match hidden size"):
        layer_norm(x, torch.ones(7), None, 1e-5)


def test_auto_takes_it_on_cuda_only_and_forced_it_runs_anywhere():
    import megatron_vlm.kernels as K

    assert DEFAULT_REGISTRY.choose("layer_norm", "cuda", torch.bfloat16) == "torch_fused"
    assert DEFAULT_REGISTRY.choose("layer_norm", "cpu", torch.float32) == "torch"
    x, w, b = torch.randn(3, 16), torch.randn(16), torch.randn(16)
    with K.use_backends({"layer_norm": "torch_fused"}):
        assert DEFAULT_REGISTRY.choose("layer_norm", "cpu", torch.float32) == "torch_fused"
        torch.testing.assert_close(K.layer_norm(x, w, b, 1e-5), reference(x, w, b, 1e-5), atol=2e-6, rtol=1e-5)
