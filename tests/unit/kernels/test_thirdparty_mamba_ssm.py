"""The mamba-ssm adapter (`kernels/thirdparty/mamba_ssm.py`).

On the CPU (always): the adapter runs against stand-ins of `mamba_ssm.ops.triton.ssd_combined` and
`mamba_ssm.ops.triton.selective_state_update` written here from the package's documented interfaces —
`mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
dt_softplus=False, dt_limit, return_final_states, return_varlen_states)` (initial states per batch row,
`seq_idx` [B, T] int32 restarting the state, varlen states per `cu_seqlens` sequence) and
`selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=False)` with per-channel A
[H, P, N], dt [B, H, P], D / dt_bias [H, P] — computed token by token in float64 (not chunked, unlike our
reference), and must give our reference's numbers and gradients; the fallbacks are logged. On a GPU with
the package (`gpu` marker): the real kernels against the reference."""
from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_vlm.kernels.reference import ssd as reference
from megatron_vlm.kernels.thirdparty import mamba_ssm as adapter


def _discretize(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _fake_package(calls):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        batch, total, heads, headdim = x.shape
        groups, dstate = B.shape[2:]
        assert dt.shape == (batch, total, heads) and A.shape == (heads,) and C.shape == B.shape and chunk_size > 0
        if seq_idx is not None:
            assert seq_idx.dtype == torch.int32 and seq_idx.shape == (batch, total)
        if return_varlen_states:
            assert cu_seqlens is not None and batch == 1
        if initial_states is not None:
            assert initial_states.shape == (batch, heads, headdim, dstate)
        calls.append(("scan", seq_idx is not None, initial_states is not None, return_final_states, return_varlen_states))
        dtd = _discretize(dt, dt_bias, dt_softplus, dt_limit)
        state = initial_states.double() if initial_states is not None else x.new_zeros(batch, heads, headdim, dstate,
                                                                                        dtype=torch.float64)
        rep = heads // groups
        ys, varlen = [], []
        ends = set(cu_seqlens[1:].tolist()) if return_varlen_states else set()
        for t in range(total):
            if seq_idx is not None and t > 0:
                state = torch.where((seq_idx[:, t] != seq_idx[:, t - 1])[:, None, None, None], torch.zeros_like(state), state)
            bt, ct = B[:, t].double().repeat_interleave(rep, 1), C[:, t].double().repeat_interleave(rep, 1)
            decay = torch.exp(dtd[:, t] * A.double())[..., None, None]
            state = decay * state + (dtd[:, t, :, None] * x[:, t].double())[..., None] * bt[:, :, None, :]
            y = torch.einsum("bhpn,bhn->bhp", state, ct)
            if D is not None:
                y = y + (D.double()[:, None] if D.dim() == 1 else D.double()) * x[:, t].double()
            if z is not None:
                y = y * F.silu(z[:, t].double())
            ys.append(y)
            if t + 1 in ends:
                varlen.append(state[0])
        out = torch.stack(ys, 1).to(x.dtype)
        extra = [state] if return_final_states else []
        if return_varlen_states:
            extra.append(torch.stack(varlen))
        return (out, *extra) if extra else out

    def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        batch, heads, headdim, dstate = state.shape
        assert x.shape == dt.shape == (batch, heads, headdim) and A.shape == (heads, headdim, dstate)
        assert B.shape == C.shape and B.shape[0] == batch and B.shape[2] == dstate
        # mamba-ssm 2.3.2's wrapper reads dt_bias.stride() and unpacks D's strides with no None check
        assert D is not None and dt_bias is not None, "selective_state_update fails on D / dt_bias = None"
        assert D.shape == (heads, headdim) and dt_bias.shape == (heads, headdim)
        calls.append(("update",))
        rep = heads // B.shape[1]
        dtd = _discretize(dt, dt_bias, dt_softplus, (0.0, math.inf))
        bt, ct = B.double().repeat_interleave(rep, 1), C.double().repeat_interleave(rep, 1)
        new = state.double() * torch.exp(A.double() * dtd[..., None]) + (bt[:, :, None, :] * dtd[..., None]) * x.double()[..., None]
        state.copy_(new.to(state.dtype))
        out = (new * ct[:, :, None, :]).sum(-1)
        if D is not None:
            out = out + x.double() * D.double()
        if z is not None:
            out = out * F.silu(z.double())
        return out.to(x.dtype)

    pkg = types.ModuleType("mamba_ssm")
    ops = types.ModuleType("mamba_ssm.ops")
    tri = types.ModuleType("mamba_ssm.ops.triton")
    combined = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    update = types.ModuleType("mamba_ssm.ops.triton.selective_state_update")
    combined.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    update.selective_state_update = selective_state_update
    return {"mamba_ssm": pkg, "mamba_ssm.ops": ops, "mamba_ssm.ops.triton": tri,
            "mamba_ssm.ops.triton.ssd_combined": combined, "mamba_ssm.ops.triton.selective_state_update": update}


@pytest.fixture
def fake(monkeypatch):
    calls: list = []
    for name, mod in _fake_package(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    adapter._logged.clear()
    return calls


def _scan_inputs(batch=2, total=11, heads=4, headdim=3, groups=2, dstate=5, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_(grad)

    x, dt = r(batch, total, heads, headdim), r(batch, total, heads, scale=0.5)
    A = (-torch.rand(heads, generator=g, dtype=torch.float64) - 0.1).requires_grad_(grad)
    B, C = r(batch, total, groups, dstate), r(batch, total, groups, dstate)
    extra = dict(D=r(heads), z=r(batch, total, heads, headdim), dt_bias=r(heads, scale=0.3))
    return (x, dt, A, B, C), extra


def test_chunk_scan_with_states_matches_the_reference(fake):
    args, extra = _scan_inputs()
    init = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    kw = dict(chunk_size=4, initial_states=init, return_final_states=True, dt_limit=(0.01, 2.0), **extra)
    y, final = adapter.ssd_chunk_scan(*args, **kw)
    y_ref, final_ref = reference.ssd_chunk_scan(*args, **kw)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(final, final_ref.float())
    assert final.dtype == torch.float32
    assert fake == [("scan", False, True, True, False)]


def test_packed_scan_seq_idx_gradients_and_varlen_states(fake):
    args, extra = _scan_inputs(batch=1, total=13, grad=True)
    cu = torch.tensor([0, 3, 9, 13], dtype=torch.int32)
    y = adapter.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, **extra)
    y_ref = reference.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, **extra)
    torch.testing.assert_close(y, y_ref)
    leaves = [*args, *extra.values()]
    w = torch.randn_like(y)
    grads = torch.autograd.grad((y * w).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), leaves)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # rollout prefill: final state per sequence through return_varlen_states
        y2, finals = adapter.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, return_final_states=True, **extra)
        _, finals_ref = reference.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, return_final_states=True, **extra)
    torch.testing.assert_close(finals, finals_ref.float())
    assert fake == [("scan", True, False, False, False), ("scan", True, False, False, True)]


def test_unsupported_scans_fall_back_and_say_why(fake, caplog):
    args, extra = _scan_inputs(batch=1, total=9, grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        a = adapter.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, initial_states=torch.zeros(2, 4, 3, 5,
                                   dtype=torch.float64), **extra)
        b = adapter.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, return_final_states=True, **extra)
    torch.testing.assert_close(a, reference.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, **extra))
    torch.testing.assert_close(b[1], reference.ssd_chunk_scan(*args, chunk_size=4, cu_seqlens=cu, return_final_states=True,
                                                              **extra)[1])
    assert fake == []
    assert "initial states" in caplog.text and "no backward" in caplog.text


@pytest.mark.parametrize("per_channel_d", [False, True])
def test_state_update_matches_the_reference_in_place(fake, per_channel_d):
    g = torch.Generator().manual_seed(3)
    b, h, p, gr, n = 3, 4, 2, 2, 5
    state = torch.randn(b, h, p, n, generator=g, dtype=torch.float64)
    x, dt = torch.randn(b, h, p, generator=g, dtype=torch.float64), torch.randn(b, h, generator=g, dtype=torch.float64)
    A = -torch.rand(h, generator=g, dtype=torch.float64)
    B, C = torch.randn(b, gr, n, generator=g, dtype=torch.float64), torch.randn(b, gr, n, generator=g, dtype=torch.float64)
    D = torch.randn(h, p, generator=g, dtype=torch.float64) if per_channel_d else torch.randn(h, generator=g, dtype=torch.float64)
    kw = dict(D=D, z=torch.randn(b, h, p, generator=g, dtype=torch.float64), dt_bias=torch.randn(h, generator=g, dtype=torch.float64))
    ours_state, ref_state = state.clone(), state.clone()
    y = adapter.ssd_state_update(ours_state, x, dt, A, B, C, **kw)
    torch.testing.assert_close(y, reference.ssd_state_update(ref_state, x, dt, A, B, C, **kw))
    torch.testing.assert_close(ours_state, ref_state)
    assert fake == [("update",)]


@pytest.mark.parametrize("dt_limit", [(0.0, 0.5), (0.9, math.inf)])
def test_state_update_with_dt_limit_discretises_dt_itself(fake, dt_limit):
    """selective_state_update has no clamp: the adapter hands it dt already discretised (bias, softplus, clamp) —
    the limits here bind (softplus(1 + 0.2) = 1.46 > 0.5; softplus(-1 + 0.2) = 0.37 < 0.9)."""
    state = torch.randn(2, 2, 2, 3, dtype=torch.float64)
    dt = torch.tensor([[1.0, -1.0], [0.5, -0.5]], dtype=torch.float64)
    args = (torch.randn(2, 2, 2, dtype=torch.float64), dt, -torch.ones(2, dtype=torch.float64),
            torch.randn(2, 1, 3, dtype=torch.float64), torch.randn(2, 1, 3, dtype=torch.float64))
    kw = dict(dt_bias=torch.full((2,), 0.2, dtype=torch.float64), D=torch.ones(2, dtype=torch.float64), dt_limit=dt_limit)
    ours_state, ref_state = state.clone(), state.clone()
    y = adapter.ssd_state_update(ours_state, *args, **kw)
    torch.testing.assert_close(y, reference.ssd_state_update(ref_state, *args, **kw))
    torch.testing.assert_close(ours_state, ref_state)
    unclamped = reference.ssd_state_update(state.clone(), *args, **{**kw, "dt_limit": (0.0, math.inf)})
    assert not torch.allclose(y, unclamped)
    assert fake == [("update",)]


def test_auto_picks_it_on_cuda_only(fake):
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        for op in ("ssd_chunk_scan", "ssd_state_update"):
            assert DEFAULT_REGISTRY.choose(op, "cuda", torch.bfloat16) == "mamba_ssm"
            assert DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) == "torch"
            assert "cuda" in DEFAULT_REGISTRY.availability(op, torch.zeros(1))["mamba_ssm"]
    finally:
        DEFAULT_REGISTRY.clear_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_package_matches_the_reference(dtype):
    from megatron_vlm.testing import mamba_ssm_triton

    if not mamba_ssm_triton.installed():
        pytest.skip("mamba_ssm is not installed")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with mamba_ssm_triton.triton_modules():
        _real_package_matches_the_reference(dtype)


def _real_package_matches_the_reference(dtype):
    args, extra = _scan_inputs(batch=1, total=300, heads=8, headdim=64, groups=1, dstate=128)
    args = [t.to("cuda", dtype if t.dim() > 1 else torch.float32) for t in args]
    extra = {k: v.to("cuda", dtype if v.dim() > 1 else torch.float32) for k, v in extra.items()}
    cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        y, fin = adapter.ssd_chunk_scan(*args, chunk_size=64, cu_seqlens=cu, return_final_states=True, **extra)
        y_ref, fin_ref = reference.ssd_chunk_scan(*args, chunk_size=64, cu_seqlens=cu, return_final_states=True, **extra)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(fin, fin_ref, **tol)


@pytest.mark.parametrize("installed", [False, True])
def test_forced_on_the_cpu_names_the_reason(installed, monkeypatch):
    """Absent (find_spec finds nothing, whether or not this machine has it): "not installed"; present: the CPU
    tensor is the reason (the package is never imported for it)."""
    import importlib.util

    from megatron_vlm import kernels as K
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if installed else None)
                        if name == "mamba_ssm" else find_spec(name, *a))
    DEFAULT_REGISTRY.clear_cache()
    try:
        (x, dt, A, B, C), _ = _scan_inputs(batch=1, total=4)
        reason = "mamba_ssm needs a cuda tensor" if installed else "mamba_ssm is not installed"
        with K.use_backends({"ssd_chunk_scan": "mamba_ssm"}), \
                pytest.raises(K.BackendUnavailableError, match=rf"'ssd_chunk_scan'.*'mamba_ssm'.*{reason}"):
            K.ssd_chunk_scan(x, dt, A, B, C, chunk_size=4)
    finally:
        DEFAULT_REGISTRY.clear_cache()


def test_state_update_without_d_or_dt_bias(fake):
    """No D and no dt_bias: the adapter passes zeros (mamba-ssm 2.3.2's wrapper fails on None there)."""
    g = torch.Generator().manual_seed(4)
    state = torch.randn(2, 4, 2, 3, generator=g, dtype=torch.float64)
    args = (torch.randn(2, 4, 2, generator=g, dtype=torch.float64), torch.randn(2, 4, generator=g, dtype=torch.float64),
            -torch.rand(4, generator=g, dtype=torch.float64), torch.randn(2, 2, 3, generator=g, dtype=torch.float64),
            torch.randn(2, 2, 3, generator=g, dtype=torch.float64))
    ours_state, ref_state = state.clone(), state.clone()
    torch.testing.assert_close(adapter.ssd_state_update(ours_state, *args), reference.ssd_state_update(ref_state, *args))
    torch.testing.assert_close(ours_state, ref_state)
    assert fake == [("update",)]
