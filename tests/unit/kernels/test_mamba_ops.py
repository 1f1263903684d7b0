"""Mamba2 ops (causal_conv1d, ssd_chunk_scan, ssd_state_update) against simple loops and transformers.

Ground truths written independently of the code under test: a per-tap loop for the convolution,
nn.Conv1d with left padding (how transformers' NemotronH torch path runs it), a token-by-token loop
of the SSM recurrence, and transformers' own `mamba2_chunk_scan` torch implementation.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_vlm.kernels.reference.causal_conv1d import causal_conv1d
from megatron_vlm.kernels.reference.ssd import ssd_chunk_scan, ssd_state_update

# ----------------------------------------------------------------------------- causal conv1d


def conv_loop(x, weight, bias, activation, initial_state=None):
    """out[b,d,t] = bias[d] + sum_w weight[d,w] * xpad[b,d,t+w], one tap at a time."""
    B, D, T = x.shape
    W = weight.shape[1]
    state = torch.zeros(B, D, W - 1, dtype=x.dtype) if initial_state is None else initial_state
    xpad = torch.cat([state, x], dim=-1)
    out = torch.zeros(B, D, T, dtype=x.dtype)
    for t in range(T):
        for w in range(W):
            out[:, :, t] += weight[:, w] * xpad[:, :, t + w]
    if bias is not None:
        out = out + bias[None, :, None]
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("T", [1, 3, 7, 19])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_matches_loop(T, activation, with_bias):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, 5, T, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64) if with_bias else None
    out = causal_conv1d(x, w, b, activation=activation)
    torch.testing.assert_close(out, conv_loop(x, w, b, activation), rtol=1e-12, atol=1e-12)


def test_causal_conv1d_matches_padded_nn_conv1d():
    """transformers' NemotronH torch path: Conv1d(groups=D, padding=W-1) cut to the first T outputs."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=True)
    x = torch.randn(3, 6, 11)
    ref = F.silu(conv(x)[..., :11])
    out = causal_conv1d(x, conv.weight.squeeze(1), conv.bias, activation="silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [1, 2, 5])
def test_causal_conv1d_state_continues_sequence(split):
    """Running [0:split] then [split:] with the carried state equals one run (this is decoding)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, generator=g, dtype=torch.float64)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    full = causal_conv1d(x, w, b)
    first, state = causal_conv1d(x[..., :split], w, b, return_final_state=True)
    assert state.shape == (2, 4, 3)
    second = causal_conv1d(x[..., split:], w, b, initial_state=state)
    torch.testing.assert_close(torch.cat([first, second], -1), full, rtol=1e-12, atol=1e-12)
    # token-by-token decoding
    state = None
    outs = []
    for t in range(9):
        o, state = causal_conv1d(x[..., t : t + 1], w, b, initial_state=state, return_final_state=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, -1), full, rtol=1e-12, atol=1e-12)
    # the state holds the last W-1 raw inputs
    torch.testing.assert_close(state, x[..., -3:])


def test_causal_conv1d_packed_equals_separate():
    g = torch.Generator().manual_seed(2)
    lens = [5, 1, 8]
    xs = [torch.randn(1, 3, n, generator=g, dtype=torch.float64) for n in lens]
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    init = torch.randn(3, 3, 3, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    out, final = causal_conv1d(torch.cat(xs, -1), w, b, cu_seqlens=cu, initial_state=init, return_final_state=True)
    for i, x in enumerate(xs):
        ref, ref_state = causal_conv1d(x, w, b, initial_state=init[i : i + 1], return_final_state=True)
        torch.testing.assert_close(out[..., cu[i] : cu[i + 1]], ref)
        torch.testing.assert_close(final[i : i + 1], ref_state)


def test_causal_conv1d_grads_match_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    go = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((causal_conv1d(x, w, b) * go).sum(), (x, w, b))
    ref = torch.autograd.grad((conv_loop(x, w, b, "silu") * go).sum(), (x, w, b))
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_causal_conv1d_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 13, generator=g)
    w = torch.randn(8, 4, generator=g)
    ref = causal_conv1d(x, w, None)
    out = causal_conv1d(x.bfloat16(), w.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=3e-2)


def test_causal_conv1d_errors_name_the_problem():
    x = torch.randn(1, 4, 5)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, torch.randn(3, 4))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, torch.randn(4, 4), activation="gelu")
    with pytest.raises(ValueError, match="batch 1"):
        causal_conv1d(torch.randn(2, 4, 5), torch.randn(4, 4), cu_seqlens=torch.tensor([0, 5]))


# ----------------------------------------------------------------------------- SSD


def ssd_loop(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf), state=None):
    """The SSM recurrence token by token: s = exp(dt A) s + dt x B^T ; y = s C + D x ; y *= silu(z)."""
    b, T, h, p = x.shape
    n = B.shape[-1]
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    s = torch.zeros(b, h, p, n, dtype=x.dtype) if state is None else state.clone()
    ys = []
    for t in range(T):
        s = torch.exp(dt[:, t] * A)[:, :, None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (s * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + (D[:, None] if D.dim() == 1 else D) * x[:, t]
        if z is not None:
            y = y * F.silu(z[:, t])
        ys.append(y)
    return torch.stack(ys, 1), s


def make_ssd_inputs(seed, b=2, T=11, h=4, p=3, g=2, n=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=dtype)

    return dict(
        x=r(b, T, h, p), dt=r(b, T, h) * 0.5, A=-torch.rand(h, generator=gen, dtype=dtype) * 2 - 0.1,
        B=r(b, T, g, n), C=r(b, T, g, n), D=r(h), z=r(b, T, h, p), dt_bias=r(h) * 0.3,
    )


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (8, 4), (19, 8), (5, 32)])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_chunk_scan_matches_recurrence(T, chunk, groups):
    inp = make_ssd_inputs(T * 10 + groups, T=T, g=groups)
    y, final = ssd_chunk_scan(**inp, chunk_size=chunk, return_final_states=True)
    ref_y, ref_s = ssd_loop(**inp)
    torch.testing.assert_close(y, ref_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_s, rtol=1e-10, atol=1e-10)


def test_ssd_chunk_scan_options():
    """No D / no z / D per channel [H, P] / dt_limit clamp / no softplus."""
    inp = make_ssd_inputs(5, T=9)
    for extra in (dict(D=None, z=None), dict(D=torch.randn(4, 3, dtype=torch.float64)),
                  dict(dt_limit=(0.4, 0.9)), dict(dt_softplus=False, dt=inp["dt"].abs(), dt_bias=None)):
        kw = {**inp, **extra}
        torch.testing.assert_close(ssd_chunk_scan(**kw, chunk_size=4), ssd_loop(**kw)[0], rtol=1e-10, atol=1e-10)


def test_ssd_chunk_scan_matches_transformers_torch_path():
    """transformers' NemotronH `mamba2_chunk_scan` (its own segsum implementation) as a second reference."""
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    fn = getattr(nh.mamba2_chunk_scan, "__wrapped__", nh.mamba2_chunk_scan)
    inp = make_ssd_inputs(6, T=13, dtype=torch.float32)
    init = torch.randn(2, 4, 3, 5)
    kw = dict(chunk_size=4, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.05, math.inf),
              initial_states=init, return_final_states=True)
    ref_y, ref_s = fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], **kw)
    y, s = ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], **kw)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-4)


def test_ssd_initial_state_and_step_decoding_continue_the_scan():
    inp = make_ssd_inputs(7, T=10)
    full_y, full_s = ssd_chunk_scan(**inp, chunk_size=4, return_final_states=True)
    cut = 6
    first = {k: (v[:, :cut] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y1, s1 = ssd_chunk_scan(**first, chunk_size=4, return_final_states=True)
    state = s1.clone()
    ys = [y1]
    for t in range(cut, 10):
        ys.append(ssd_state_update(
            state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t],
            D=inp["D"], z=inp["z"][:, t], dt_bias=inp["dt_bias"],
        )[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), full_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, full_s, rtol=1e-10, atol=1e-10)
    # restarting the chunked scan from a carried state also continues it
    rest = {k: (v[:, cut:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y2 = ssd_chunk_scan(**rest, chunk_size=3, initial_states=s1)
    torch.testing.assert_close(y2, full_y[:, cut:], rtol=1e-10, atol=1e-10)


def test_ssd_packed_equals_separate():
    lens = [4, 1, 9]
    seqs = [make_ssd_inputs(20 + i, b=1, T=n) for i, n in enumerate(lens)]
    shared = {k: seqs[0][k] for k in ("A", "D", "dt_bias")}
    packed = {k: torch.cat([s[k] for s in seqs], 1) for k in ("x", "dt", "B", "C", "z")}
    init = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    cu = torch.tensor([0, 4, 5, 14], dtype=torch.int32)
    y, final = ssd_chunk_scan(**packed, **shared, chunk_size=4, cu_seqlens=cu, initial_states=init,
                              return_final_states=True)
    for i, s in enumerate(seqs):
        per = {k: s[k] for k in ("x", "dt", "B", "C", "z")}
        ry, rs = ssd_loop(**per, **shared, state=init[i : i + 1])
        torch.testing.assert_close(y[:, cu[i] : cu[i + 1]], ry, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[i : i + 1], rs, rtol=1e-10, atol=1e-10)


def test_ssd_grads_match_recurrence():
    inp = make_ssd_inputs(8, T=7)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    go = torch.randn(2, 7, 4, 3, dtype=torch.float64)
    names = list(leaves)
    grads = torch.autograd.grad((ssd_chunk_scan(**leaves, chunk_size=3) * go).sum(), [leaves[k] for k in names])
    ref = torch.autograd.grad((ssd_loop(**leaves)[0] * go).sum(), [leaves[k] for k in names])
    for k, a, r in zip(names, grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad of {k}: {m}")


def test_ssd_bf16_close_to_fp32():
    inp = make_ssd_inputs(9, T=12, dtype=torch.float32)
    ref = ssd_chunk_scan(**inp, chunk_size=4)
    half = {k: (v.bfloat16() if k in ("x", "B", "C", "z") else v) for k, v in inp.items()}
    out = ssd_chunk_scan(**half, chunk_size=4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)


def test_ssd_errors_name_the_problem():
    inp = make_ssd_inputs(10, T=4)
    with pytest.raises(ValueError, match="dt must be"):
        ssd_chunk_scan(**{**inp, "dt": inp["dt"][:, :3]}, chunk_size=4)
    with pytest.raises(ValueError, match="groups"):
        ssd_chunk_scan(**{**inp, "B": torch.randn(2, 4, 3, 5, dtype=torch.float64)}, chunk_size=4)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_chunk_scan(**inp, chunk_size=4, initial_states=torch.zeros(2, 4, 3, 6, dtype=torch.float64))
