"""Reference Mamba2 SSD (state space duality) scan: chunked for sequences, one step for decoding.

Shapes follow `mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined` (so its kernels can be
swapped in) with B = batch, T = time, H = heads, P = head dim, G = groups (B/C shared by H/G heads),
N = state size:

    x `[B, T, H, P]`, dt `[B, T, H]`, A `[H]` (negative), B and C `[B, T, G, N]`,
    D `[H]` or `[H, P]`, z `[B, T, H, P]`, dt_bias `[H]`, states `[B, H, P, N]`.

The recurrence, per head h (dt after `+ dt_bias`, softplus, clamp to `dt_limit`):

    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t (outer) B_t        # [P, N]
    y_t     = state_t . C_t + D * x_t ;   y_t *= silu(z_t) when z is given

`ssd_chunk_scan` evaluates it in chunks of `chunk_size` steps: inside a chunk as a masked
"attention" (C_l . B_s weighted by the decay between s and l), across chunks by carrying the
state of each chunk boundary; `ssd_state_update` is the same recurrence for one token, updating a
cached state in place (decoding). All math runs in fp32; y has x's dtype, states are fp32.
Packed sequences use `cu_seqlens` (B must be 1): the state restarts at every sequence start, and
initial / final states are per sequence `[n, H, P, N]`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32 for half types, fp64 stays fp64 (exact gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _discretize_dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = _acc(dt)
    if dt_bias is not None:
        dt = dt + _acc(dt_bias)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _expand_groups(t: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    groups = t.shape[-2]
    if num_heads % groups != 0:
        raise ValueError(f"ssd: {name} has {groups} groups, which does not divide {num_heads} heads")
    return _acc(t).repeat_interleave(num_heads // groups, dim=-2)


def _apply_skip_and_gate(y, x, D, z):
    if D is not None:
        skip = _acc(D)
        skip = skip[:, None] if skip.dim() == 1 else skip  # [H, 1] or [H, P]
        y = y + skip * _acc(x)
    if z is not None:
        y = y * F.silu(_acc(z))
    return y


def _chunk_scan_dense(x, dt, A, B, C, chunk_size, initial_states):
    """x [b,T,h,p] fp32 (not yet scaled by dt), dt [b,T,h] fp32 discretized, A [h], B/C [b,T,h,n].

    Returns y [b,T,h,p] (without the D skip) and the final state [b,h,p,n].
    """
    batch, seqlen, heads, headdim = x.shape
    dstate = B.shape[-1]
    pad = (-seqlen) % chunk_size
    if pad:
        # Padded steps have dt = 0: no decay, no input, so the carried state is unchanged.
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    nchunks = x.shape[1] // chunk_size
    xc = x.view(batch, nchunks, chunk_size, heads, headdim)
    dtc = dt.view(batch, nchunks, chunk_size, heads)
    Bc = B.view(batch, nchunks, chunk_size, heads, dstate)
    Cc = C.view(batch, nchunks, chunk_size, heads, dstate)

    log_decay = torch.cumsum(dtc * _acc(A), dim=2)  # [b,c,l,h]: sum of dt*A up to and including l
    x_dt = xc * dtc[..., None]

    # Intra-chunk: y_l += sum_{s<=l} exp(logd_l - logd_s) (C_l . B_s) dt_s x_s. Mask before exp so
    # the (positive) s > l entries never overflow.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    diff = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [b,c,l,s,h]
    decay = torch.exp(diff.masked_fill(~causal[None, None, :, :, None], -math.inf))
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * decay
    y = torch.einsum("bclsh,bcshp->bclhp", scores, x_dt)

    # State contributed by each chunk alone, at its end: sum_s exp(logd_end - logd_s) dt_s x_s B_s^T.
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay)  # [b,c,l,h]
    chunk_states = torch.einsum("bclh,bclhn,bclhp->bchpn", to_end, Bc, x_dt)
    chunk_decay = torch.exp(log_decay[:, :, -1, :])  # [b,c,h]: decay across a whole chunk

    # Inter-chunk: carry the state over chunk boundaries (sequential over T / chunk_size steps).
    if initial_states is None:
        state = x.new_zeros(batch, heads, headdim, dstate)
    else:
        if tuple(initial_states.shape) != (batch, heads, headdim, dstate):
            raise ValueError(
                f"ssd_chunk_scan: initial_states must be [{batch}, {heads}, {headdim}, {dstate}], "
                f"got {tuple(initial_states.shape)}"
            )
        state = _acc(initial_states)
    if nchunks == 0:  # an empty sequence (a zero-length packed segment): no output, the state passes through
        return x.new_zeros(batch, 0, heads, headdim), state
    start_states = []
    for c in range(nchunks):
        start_states.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    starts = torch.stack(start_states, dim=1)  # [b,c,h,p,n]

    # Off-diagonal: the state entering the chunk, decayed to position l and read out by C_l.
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, starts) * torch.exp(log_decay)[..., None]
    y = y.reshape(batch, nchunks * chunk_size, heads, headdim)[:, :seqlen]
    return y, state


@torch.compiler.disable
def _chunk_scan_packed(xf, dt, A, Bh, Ch, chunk_size, initial_states, cu_seqlens):
    """The dense scan per packed sequence, its bounds read on the host. Eager under torch.compile (a hybrid
    model's Mamba2 layers with `parallel.compile`): traced, the host read would break the graph and the bounds,
    new with every packed batch, would be constants of the code after it, compiled again at every step."""
    seqlen = xf.shape[1]
    bounds = [int(v) for v in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seqlen or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"ssd_chunk_scan: cu_seqlens must rise from 0 to T={seqlen}, got {bounds}")
    num_seqs = len(bounds) - 1
    if initial_states is not None and initial_states.shape[0] != num_seqs:
        raise ValueError(
            f"ssd_chunk_scan: packed initial_states needs one row per sequence ({num_seqs}), "
            f"got {initial_states.shape[0]}"
        )
    ys, finals = [], []
    for i in range(num_seqs):
        s, e = bounds[i], bounds[i + 1]
        init = None if initial_states is None else initial_states[i : i + 1]
        y_i, f_i = _chunk_scan_dense(xf[:, s:e], dt[:, s:e], A, Bh[:, s:e], Ch[:, s:e], chunk_size, init)
        ys.append(y_i)
        finals.append(f_i)
    return torch.cat(ys, dim=1), torch.cat(finals, dim=0)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = (0.0, math.inf),
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Chunked SSD scan (see module docstring). Returns y, or (y, final_states) when asked."""
    if x.dim() != 4:
        raise ValueError(f"ssd_chunk_scan: x must be [B, T, H, P], got {tuple(x.shape)}")
    batch, seqlen, heads, _ = x.shape
    if tuple(dt.shape) != (batch, seqlen, heads):
        raise ValueError(f"ssd_chunk_scan: dt must be [{batch}, {seqlen}, {heads}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,):
        raise ValueError(f"ssd_chunk_scan: A must be [{heads}], got {tuple(A.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 4 or t.shape[:2] != (batch, seqlen):
            raise ValueError(f"ssd_chunk_scan: {name} must be [{batch}, {seqlen}, G, N], got {tuple(t.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"ssd_chunk_scan: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"ssd_chunk_scan: chunk_size must be > 0, got {chunk_size}")

    dt = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _expand_groups(B, heads, "B"), _expand_groups(C, heads, "C")
    xf = _acc(x)

    if cu_seqlens is None:
        y, final = _chunk_scan_dense(xf, dt, A, Bh, Ch, chunk_size, initial_states)
    else:
        if batch != 1:
            raise ValueError(f"ssd_chunk_scan: packed input (cu_seqlens) needs batch 1, got batch {batch}")
        y, final = _chunk_scan_packed(xf, dt, A, Bh, Ch, chunk_size, initial_states, cu_seqlens)

    y = _apply_skip_and_gate(y, xf, D, z).to(x.dtype)
    return (y, final) if return_final_states else y


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = True,
    dt_limit: Sequence[float] = (0.0, math.inf),
) -> torch.Tensor:
    """One decoding step: x `[B, H, P]`, dt `[B, H]`, B/C `[B, G, N]`, z `[B, H, P]`.

    Updates `state` `[B, H, P, N]` in place (the per-layer SSM cache) and returns y `[B, H, P]`.
    Same discretisation (dt_bias, softplus, dt_limit clamp) as `ssd_chunk_scan`, so stepping token by
    token reproduces the chunked scan.
    """
    if x.dim() != 3:
        raise ValueError(f"ssd_state_update: x must be [B, H, P], got {tuple(x.shape)}")
    batch, heads, headdim = x.shape
    if tuple(state.shape[:3]) != (batch, heads, headdim) or state.dim() != 4:
        raise ValueError(f"ssd_state_update: state must be [{batch}, {heads}, {headdim}, N], got {tuple(state.shape)}")
    dt = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b,h]
    Bh, Ch = _expand_groups(B, heads, "B"), _expand_groups(C, heads, "C")  # [b,h,n]
    xf = _acc(x)
    decay = torch.exp(dt * _acc(A))[..., None, None]
    new_state = decay * _acc(state) + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    state.copy_(new_state.to(state.dtype))
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    return _apply_skip_and_gate(y, xf, D, z).to(x.dtype)
