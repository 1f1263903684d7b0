"""mamba-ssm backends (`kernels/thirdparty/mamba_ssm.py`) on a CUDA device against our references, at
Nemotron-H-like sizes: the chunked scan (batched with D / z / dt_bias and initial / final states, packed
with seq_idx and per-sequence final states), its gradients in fp32, and the decoding step token by token
against the scan. Run by `benchmarks/gpu_suite.sh` (section "tests"); skipped without CUDA or mamba-ssm.
A full mamba-ssm install is imported as it is; the Python-only wheel that `benchmarks/gpu_wheels.sh` builds
for a lease (no CUDA extension) through `triton_modules` (megatron_vlm/testing/mamba_ssm_triton.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.kernels.reference import ssd as reference
from megatron_vlm.kernels.thirdparty import mamba_ssm as adapter
from megatron_vlm.testing import mamba_ssm_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not mamba_ssm_triton.installed(), reason="mamba-ssm is not installed")]


@pytest.fixture(scope="module", autouse=True)
def _mamba_ssm_kernels():
    with mamba_ssm_triton.triton_modules():
        yield


TOL = {torch.float32: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def _inputs(batch, total, heads=16, headdim=64, groups=2, dstate=128, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt).requires_grad_(grad)

    x, dt = r(batch, total, heads, headdim), r(batch, total, heads, scale=0.5)
    A = (-torch.rand(heads, device="cuda", generator=g) - 0.1).requires_grad_(grad)
    B, C = r(batch, total, groups, dstate, scale=0.3), r(batch, total, groups, dstate, scale=0.3)
    extra = dict(D=r(heads, dt=torch.float32), z=r(batch, total, heads, headdim), dt_bias=r(heads, scale=0.3, dt=torch.float32))
    return (x, dt, A, B, C), extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_scan_with_states(dtype):
    args, extra = _inputs(2, 515, dtype=dtype)
    init = torch.randn(2, 16, 64, 128, device="cuda") * 0.1
    with torch.no_grad():
        y, fin = adapter.ssd_chunk_scan(*args, chunk_size=128, initial_states=init, return_final_states=True, **extra)
        y_ref, fin_ref = reference.ssd_chunk_scan(*args, chunk_size=128, initial_states=init, return_final_states=True, **extra)
    torch.testing.assert_close(y.float(), y_ref.float(), **TOL[dtype])
    torch.testing.assert_close(fin, fin_ref, **TOL[dtype])


def test_packed_scan_gradients_fp32():
    args, extra = _inputs(1, 600, grad=True)
    cu = torch.tensor([0, 100, 357, 600], device="cuda", dtype=torch.int32)
    inputs = [*args, *extra.values()]
    y = adapter.ssd_chunk_scan(*args, chunk_size=128, cu_seqlens=cu, **extra)
    y_ref = reference.ssd_chunk_scan(*args, chunk_size=128, cu_seqlens=cu, **extra)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    w = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad((y * w).sum(), inputs), torch.autograd.grad((y_ref * w).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_steps_follow_the_scan(dtype):
    (x, dt, A, B, C), extra = _inputs(3, 12, dtype=dtype)
    state = torch.zeros(3, 16, 64, 128, device="cuda")
    ys = []
    for t in range(12):
        step_extra = dict(D=extra["D"], z=extra["z"][:, t], dt_bias=extra["dt_bias"])
        ys.append(adapter.ssd_state_update(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], **step_extra))
    y_ref, fin_ref = reference.ssd_chunk_scan(x, dt, A, B, C, chunk_size=4, return_final_states=True, **extra)
    torch.testing.assert_close(torch.stack(ys, 1).float(), y_ref.float(), **TOL[dtype])
    torch.testing.assert_close(state, fin_ref, **TOL[dtype])
