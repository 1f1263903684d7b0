"""Transformer Engine backends (`kernels/thirdparty/transformer_engine.py`) on a CUDA device against our
references: RMSNorm (plain and with the residual) and LayerNorm values and gradients in bf16 against the
fp32 reference, attention (packed THD with GQA, causal / windowed / cross lengths, and batched) within the
rule of the low-precision attention tests (error at most 2x that of the reference computed naively in the
same dtype, plus a small floor). Run by `benchmarks/gpu_suite.sh` (section "tests"); skipped without CUDA
or without transformer_engine."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_vlm import kernels as K
from megatron_vlm.kernels.reference import norms as ref_norms
from megatron_vlm.kernels.reference.attention import attention as ref_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
te = pytest.importorskip("transformer_engine.pytorch")

from megatron_vlm.kernels.thirdparty import transformer_engine as adapter  # noqa: E402

BF16 = dict(rtol=2e-2, atol=2e-2)


def _grads(out, inputs):
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cuda").manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, device="cuda", generator=g)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("hidden", [2048, 1280, 2688])
def test_rms_norm_bf16_matches_the_reference(hidden):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    r = torch.randn(4096, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16().requires_grad_()
    for kwargs, inputs in (({}, (x, w)), ({"residual": r}, (x, r, w))):
        ours = adapter.rms_norm(x, w, 1e-6, **kwargs)
        ref = ref_norms.rms_norm(x, w, 1e-6, **kwargs)
        for a, b in zip(ours if isinstance(ours, tuple) else (ours,), ref if isinstance(ref, tuple) else (ref,)):
            torch.testing.assert_close(a.float(), b.float(), **BF16)
        for a, b in zip(_grads(ours, inputs), _grads(ref, inputs)):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * b.float().abs().max().item() ** 0.5)


def test_layer_norm_bf16_matches_the_reference():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(32 * 1025, 1024, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.randn(1024, device="cuda", generator=g).bfloat16().requires_grad_()
    b = torch.randn(1024, device="cuda", generator=g).bfloat16().requires_grad_()
    ours, ref = adapter.layer_norm(x, w, b, 1e-6), ref_norms.layer_norm(x, w, b, 1e-6)
    torch.testing.assert_close(ours.float(), ref.float(), **BF16)
    for a, c in zip(_grads(ours, (x, w, b)), _grads(ref, (x, w, b))):
        torch.testing.assert_close(a.float(), c.float(), rtol=5e-2, atol=5e-2 * c.float().abs().max().item() ** 0.5)


@pytest.mark.parametrize("causal,window,cross", [(True, None, False), (False, None, False), (True, (128, -1), False),
                                                 (True, None, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_attention_bf16_within_twice_the_naive_error(causal, window, cross, head_dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths_k = [1, 77, 199, 256]
    lengths_q = [1, 20, 64, 256] if cross else lengths_k
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), 8, head_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(lengths_k), 2, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(lengths_k), 2, head_dim, device="cuda", generator=g).bfloat16()
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window=window)
    exact = ref_attention(q.double(), k.double(), v.double(), **kw)
    naive = ref_attention(q, k, v, upcast=False, **kw)
    got = adapter.attention(q, k, v, **kw)
    err = (got.double() - exact).abs().max().item()
    ref_err = (naive.double() - exact).abs().max().item()
    assert math.isfinite(err) and err <= 2 * ref_err + 1e-3, (err, ref_err)


def test_batched_attention_and_the_registry_choice():
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, 16, 8, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 48, 8, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, 48, 8, 128, device="cuda", generator=g).bfloat16()
    exact = ref_attention(q.double(), k.double(), v.double(), causal=True)
    naive = ref_attention(q, k, v, causal=True, upcast=False)
    with K.use_backends({"attention": "transformer_engine"}):
        got = K.attention(q, k, v, causal=True)
    err = (got.double() - exact).abs().max().item()
    assert err <= 2 * (naive.double() - exact).abs().max().item() + 1e-3
