"""causal-conv1d backend (`kernels/thirdparty/causal_conv1d.py`) on a CUDA device against our reference, at a
Nemotron-H-like conv width (4) and channel count: the forward and gradients (batched, with initial / final
states; packed through seq_idx), and decoding steps through `causal_conv1d_update` against the whole
sequence. Run by `benchmarks/gpu_suite.sh` (section "tests"); skipped without CUDA or causal-conv1d."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_vlm.kernels.reference.causal_conv1d import causal_conv1d as reference
from megatron_vlm.kernels.thirdparty import causal_conv1d as adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("causal_conv1d") is None, reason="causal-conv1d is not installed")]

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(batch, total, dim=384, width=4, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, total, dim, device="cuda", generator=g).to(dtype).transpose(1, 2)  # channel-last, as the mixer
    w = (torch.randn(dim, width, device="cuda", generator=g) * 0.5).to(dtype)
    b = (torch.randn(dim, device="cuda", generator=g) * 0.1).to(dtype)
    return [t.requires_grad_(grad) for t in (x, w, b)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_with_states_and_gradients(dtype):
    x, w, b = _inputs(2, 300, dtype=dtype, grad=True)
    state = torch.randn(2, 384, 3, device="cuda").to(dtype).float().requires_grad_(True)
    out, final = adapter.causal_conv1d(x, w, b, activation="silu", initial_state=state, return_final_state=True)
    out_ref, final_ref = reference(x, w, b, activation="silu", initial_state=state, return_final_state=True)
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])
    torch.testing.assert_close(final, final_ref.float(), **TOL[dtype])
    g = torch.randn_like(out)
    leaves = [x, w, b, state]
    for a, r in zip(torch.autograd.grad((out * g).sum(), leaves), torch.autograd.grad((out_ref * g).sum(), leaves)):
        torch.testing.assert_close(a.float(), r.float(), rtol=TOL[dtype]["rtol"] * 5, atol=TOL[dtype]["atol"] * 5 * r.abs().max().item())


def test_packed_gradients_fp32():
    x, w, b = _inputs(1, 600, grad=True)
    cu = torch.tensor([0, 100, 357, 600], device="cuda", dtype=torch.int32)
    out = adapter.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    out_ref = reference(x, w, b, activation="silu", cu_seqlens=cu)
    torch.testing.assert_close(out, out_ref, **TOL[torch.float32])
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * g).sum(), [x, w, b]), torch.autograd.grad((out_ref * g).sum(), [x, w, b])):
        torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-3 * r.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_steps_follow_the_sequence(dtype):
    x, w, b = _inputs(3, 12, dtype=dtype)
    state = torch.zeros(3, 384, 3, device="cuda")
    out_ref, final_ref = reference(x, w, b, activation="silu", initial_state=state, return_final_state=True)
    outs = []
    with torch.no_grad():
        for t in range(12):
            before = state.clone()
            out, state_next = adapter.causal_conv1d(x[..., t:t + 1], w, b, activation="silu", initial_state=state,
                                                    return_final_state=True)
            assert torch.equal(state, before)
            outs.append(out)
            state = state_next
    torch.testing.assert_close(torch.cat(outs, -1).float(), out_ref.float(), **TOL[dtype])
    torch.testing.assert_close(state, final_ref.float(), **TOL[dtype])
