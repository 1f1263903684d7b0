"""The Liger-Kernel adapters (kernels/thirdparty/liger.py) on a CUDA device against our torch references.

Skipped without CUDA or liger_kernel. bf16 tolerances: Liger multiplies silu(gate) (fp32) by up in
bf16 and chunks its cross-entropy, so the last bits differ from the fp32-then-round references.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.kernels.reference.norms import rms_norm as ref_rms_norm
from megatron_vlm.kernels.reference.swiglu import swiglu as ref_swiglu
from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as ref_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def liger():
    pytest.importorskip("liger_kernel")
    from megatron_vlm.kernels.thirdparty import liger as adapter

    return adapter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_linear_token_logprobs_without_gradients(liger, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 256, device="cuda", generator=g).to(dtype)
    weight = (0.05 * torch.randn(5000, 256, device="cuda", generator=g)).to(dtype)
    labels = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    labels[::7] = -100
    torch.testing.assert_close(liger.linear_token_logprobs(hidden, weight, labels, temperature=0.8),
                               ref_logprobs(hidden, weight, labels, temperature=0.8), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_swiglu(liger, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    x, r = (torch.randn(4, 100, 512, device="cuda", generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).to(dtype)
    torch.testing.assert_close(liger.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), **TOL[dtype])
    for a, b in zip(liger.rms_norm(x, w, 1e-6, residual=r), ref_rms_norm(x, w, 1e-6, residual=r)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(liger.swiglu(x, r), ref_swiglu(x, r), **TOL[dtype])
