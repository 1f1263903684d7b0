"""The causal-conv1d adapter (`kernels/thirdparty/causal_conv1d.py`).

On the CPU (always): the adapter runs against a stand-in `causal_conv1d` module written here from the
package's documented interface — `causal_conv1d_fn(x [B, D, T], weight [D, W], bias, seq_idx [B, T] int32,
initial_states [B, D, W-1], return_final_states, final_states_out, activation)`, widths 2-4, `seq_idx`
only without states, final states only for channel-last x — computed token by token, and must give
our reference's numbers (fallbacks included, and logged); it also makes the checks of the package's C++
extension (csrc/causal_conv1d.cpp: the channel-last kernels' D % 8 == 0 and strides multiples of 8, states and
seq_idx only channel-last, bias in the weight's dtype), so a call the real package would refuse fails here.
On a GPU with the package installed: tests/gpu/test_gpu_thirdparty_causal_conv1d.py and the `gpu` test below.
"""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from megatron_vlm.kernels.reference.causal_conv1d import causal_conv1d as reference
from megatron_vlm.kernels.thirdparty import causal_conv1d as adapter


def _fake_package():
    mod = types.ModuleType("causal_conv1d")
    calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        assert activation in (None, "silu", "swish")
        dim, width = weight.shape
        assert width in (2, 3, 4), "the package supports widths 2-4"
        if x.stride(2) != 1 and x.stride(1) != 1:  # the Python wrapper's own fix-up
            x = x.contiguous()
        # the C++ extension's checks (csrc/causal_conv1d.cpp, causal_conv1d_fwd)
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:
            assert dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
            assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "channel last layout requires strides multiples of 8"
        if bias is not None:
            assert bias.dtype == weight.dtype and bias.stride(-1) == 1 and bias.shape == (dim,)
        if seq_idx is not None:
            assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2]) and seq_idx.is_contiguous()
            assert initial_states is None and not return_final_states, "seq_idx excludes states"
            assert channel_last, "seq_idx is only supported for channel last layout"
        if initial_states is not None:
            assert channel_last, "initial_states is only supported for channel last layout"
            assert initial_states.dtype == x.dtype and initial_states.shape == (x.shape[0], dim, width - 1)
            assert initial_states.stride(1) == 1
        if return_final_states:
            assert x.stride(1) == 1, "Only channel-last layout support returning final_states_out"
        calls.append((seq_idx is not None, initial_states is not None, return_final_states))
        batch, _, total = x.shape
        out = torch.zeros_like(x, dtype=torch.float64)
        for b in range(batch):
            for t in range(total):
                acc = torch.zeros(dim, dtype=torch.float64) if bias is None else bias.double().clone()
                for w in range(width):
                    src = t - (width - 1) + w
                    if seq_idx is not None and src >= 0 and seq_idx[b, src] != seq_idx[b, t]:
                        continue
                    if src >= 0:
                        acc += weight[:, w].double() * x[b, :, src].double()
                    elif initial_states is not None:
                        acc += weight[:, w].double() * initial_states[b, :, width - 1 + src].double()
                out[b, :, t] = acc
        if activation is not None:
            out = torch.nn.functional.silu(out)
        out = out.to(x.dtype)
        if not return_final_states:
            return out
        init = initial_states if initial_states is not None else x.new_zeros(batch, dim, width - 1)
        final = torch.cat([init, x], dim=-1)[..., -(width - 1):].to(x.dtype)
        return out, final

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None):
        """x [B, D] or [B, D, T]; conv_state [B, D, state_len >= W-1], rolled in place; out shaped like x."""
        assert activation in (None, "silu", "swish") and cache_seqlens is None and conv_state_indices is None
        dim, width = weight.shape
        assert conv_state.shape[:2] == (x.shape[0], dim) and conv_state.shape[2] >= width - 1
        assert conv_state.dtype == x.dtype
        calls.append("update")
        x3 = x if x.dim() == 3 else x[..., None]
        out = torch.empty_like(x3)
        for t in range(x3.shape[-1]):
            full = torch.cat([conv_state, x3[..., t:t + 1]], dim=-1)
            conv_state.copy_(full[..., 1:])
            acc = (full[..., -width:].double() * weight.double()).sum(-1)
            acc = acc if bias is None else acc + bias.double()
            out[..., t] = (acc if activation is None else torch.nn.functional.silu(acc)).to(x.dtype)
        return out if x.dim() == 3 else out[..., 0]

    mod.causal_conv1d_fn = causal_conv1d_fn
    mod.causal_conv1d_update = causal_conv1d_update
    return mod, calls


@pytest.fixture
def fake(monkeypatch):
    mod, calls = _fake_package()
    monkeypatch.setitem(sys.modules, "causal_conv1d", mod)
    adapter._logged.clear()
    return calls


def _inputs(batch, dim, total, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, total, generator=g, dtype=torch.float64)
    return x, torch.randn(dim, width, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_plain_and_stateful_calls_match_the_reference(fake, activation):
    x, w, b = _inputs(2, 8, 7, 4)
    torch.testing.assert_close(adapter.causal_conv1d(x, w, b, activation=activation),
                               reference(x, w, b, activation=activation))
    state = torch.randn(2, 8, 3, dtype=torch.float64)
    ours = adapter.causal_conv1d(x, w, b, activation=activation, initial_state=state, return_final_state=True)
    ref = reference(x, w, b, activation=activation, initial_state=state, return_final_state=True)
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1].float())
    assert ours[1].dtype == torch.float32
    assert fake == [(False, False, False), (False, True, True)]


@pytest.mark.parametrize("activation", [None, "silu"])
def test_decoding_steps_use_the_update_kernel_and_leave_the_callers_state(fake, activation):
    """Token by token through `causal_conv1d_update` (no gradients): the outputs and the final state of the
    whole sequence at once; each step's input state is left as it was. A step that records gradients takes
    causal_conv1d_fn (the update has no backward)."""
    x, w, b = _inputs(3, 8, 6, 4)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # channel-last, as the Mamba2 mixer passes it
    state0 = torch.randn(3, 8, 3, dtype=torch.float64)
    ref_out, ref_state = reference(x, w, b, activation=activation, initial_state=state0, return_final_state=True)
    state, outs = state0.float(), []
    with torch.no_grad():
        for t in range(6):
            before = state.clone()
            out, new = adapter.causal_conv1d(x[..., t:t + 1], w, b, activation=activation, initial_state=state,
                                             return_final_state=True)
            assert torch.equal(state, before) and new.dtype == torch.float32 and out.shape == (3, 8, 1)
            outs.append(out)
            state = new
    torch.testing.assert_close(torch.cat(outs, -1), ref_out, rtol=1e-6, atol=1e-6)  # the state travels in fp32
    torch.testing.assert_close(state, ref_state.float())
    assert fake == ["update"] * 6
    wg = w.clone().requires_grad_(True)
    out, _ = adapter.causal_conv1d(x[..., :1], wg, b, activation=activation, initial_state=state0,
                                   return_final_state=True)
    out.sum().backward()
    assert wg.grad is not None and fake[-1] == (False, True, True)


def test_packed_sequences_use_seq_idx(fake):
    x, w, b = _inputs(1, 16, 9, 3)
    cu = torch.tensor([0, 2, 6, 9])
    torch.testing.assert_close(adapter.causal_conv1d(x, w, b, cu_seqlens=cu), reference(x, w, b, cu_seqlens=cu))
    assert fake == [(True, False, False)]
    assert adapter.seq_idx_from_cu_seqlens(cu, 9).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2, 2]]


def test_the_mixers_channel_last_view_is_realigned_for_the_package(fake):
    """The Mamba2 mixer passes xBC as a view of its in_proj output: stride 1 over channels but a time stride of the
    whole projection width (here 8 + 8 + 3 = 19, not a multiple of 8), which the package's channel-last kernels
    refuse: the adapter copies it (the stand-in makes the package's checks)."""
    g = torch.Generator().manual_seed(5)
    proj = torch.randn(2, 9, 19, generator=g, dtype=torch.float64)
    x = proj[..., 8:16].transpose(1, 2)  # [2, 8, 9], strides (171, 1, 19)
    _, w, b = _inputs(2, 8, 9, 4)
    assert x.stride() == (171, 1, 19)
    state = torch.randn(2, 8, 3, dtype=torch.float64)
    torch.testing.assert_close(adapter.causal_conv1d(x, w, b), reference(x, w, b))
    ours = adapter.causal_conv1d(x, w, b, initial_state=state, return_final_state=True)
    ref = reference(x, w, b, initial_state=state, return_final_state=True)
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1].float())
    packed = adapter.causal_conv1d(x[:1], w, b, cu_seqlens=torch.tensor([0, 4, 9]))
    torch.testing.assert_close(packed, reference(x[:1], w, b, cu_seqlens=torch.tensor([0, 4, 9])))
    assert fake == [(False, False, False), (False, True, True), (True, False, False)]


def test_channels_not_a_multiple_of_8_run_channel_first_or_the_reference(fake, caplog):
    """D = 5: a plain call goes to the package channel-first; calls that need its channel-last kernels (states,
    seq_idx) run the reference, logged; a decoding step (the update kernel has no such rule) still uses it."""
    x, w, b = _inputs(2, 5, 7, 4)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # channel-last, as the mixer passes it
    state = torch.randn(2, 5, 3, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        plain = adapter.causal_conv1d(x, w, b)
        stateful = adapter.causal_conv1d(x, w, b, initial_state=state, return_final_state=True)
        with torch.no_grad():
            step = adapter.causal_conv1d(x[..., :1], w, b, initial_state=state, return_final_state=True)
    torch.testing.assert_close(plain, reference(x, w, b))
    torch.testing.assert_close(stateful[0], reference(x, w, b, initial_state=state, return_final_state=True)[0])
    torch.testing.assert_close(step[0], reference(x[..., :1], w, b, initial_state=state, return_final_state=True)[0])
    assert fake == [(False, False, False), "update"]
    assert "5 channels" in caplog.text


def test_unsupported_calls_fall_back_to_the_reference_and_say_why(fake, caplog):
    x, w, b = _inputs(1, 3, 9, 3)
    cu = torch.tensor([0, 4, 9])
    state = torch.randn(2, 3, 2, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        ours = adapter.causal_conv1d(x, w, b, cu_seqlens=cu, initial_state=state, return_final_state=True)
        x5, w5, b5 = _inputs(1, 3, 6, 5)
        wide = adapter.causal_conv1d(x5, w5, b5)
    ref = reference(x, w, b, cu_seqlens=cu, initial_state=state, return_final_state=True)
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(wide, reference(x5, w5, b5))
    assert fake == []  # neither call reached the package
    assert "seq_idx excludes states" in caplog.text and "width (5,)" in caplog.text


def test_auto_picks_it_on_cuda_only_and_says_why_not_elsewhere(fake):
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        assert DEFAULT_REGISTRY.choose("causal_conv1d", "cuda", torch.bfloat16) == "causal_conv1d"
        assert DEFAULT_REGISTRY.choose("causal_conv1d", "cpu", torch.float32) == "torch"
        why = DEFAULT_REGISTRY.availability("causal_conv1d", torch.zeros(1))["causal_conv1d"]
        assert why and "cuda" in why
    finally:
        DEFAULT_REGISTRY.clear_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_package_matches_the_reference(dtype):
    pytest.importorskip("causal_conv1d")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, w, b = (t.to("cuda", dtype) for t in _inputs(2, 64, 300, 4))
    cu = torch.tensor([0, 100, 300], device="cuda")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(adapter.causal_conv1d(x, w, b), reference(x, w, b), **tol)
    torch.testing.assert_close(adapter.causal_conv1d(x[:1], w, b, cu_seqlens=cu), reference(x[:1], w, b, cu_seqlens=cu), **tol)
