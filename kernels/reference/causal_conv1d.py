"""Reference causal depthwise conv1d: the short convolution of the Mamba2 mixer.

Layout follows the `causal_conv1d` package (Dao-AILab) so its kernels can be swapped in:

- `x`       `[B, D, T]` channels first (D = conv channels, T = time);
- `weight`  `[D, W]` one width-W filter per channel (nn.Conv1d's `[D, 1, W]` squeezed);
- `bias`    `[D]` or None;
- `initial_state` `[B, D, W-1]`: the W-1 inputs that precede `x[..., 0]` (zeros when None);
- final state `[B, D, W-1]`: the last W-1 inputs, `initial_state` included when T < W-1. This is the
  decoding conv state: feeding the next token with `initial_state=final_state` continues the sequence.

    out[b, d, t] = act(bias[d] + sum_w weight[d, w] * xpad[b, d, t + w]),  xpad = cat(state, x)

Packed sequences: with `cu_seqlens` (int `[n+1]`, cumulative lengths from 0, B must be 1) every
sequence is convolved on its own: no tap crosses a boundary; `initial_state` / the final state are
then per sequence, `[n, D, W-1]`. Math runs in fp32 (fp64 inputs stay fp64); the output has x's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_ACTIVATIONS = (None, "silu", "swish")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32 for half types, fp64 stays fp64 (exact gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_inputs(x, weight, bias, activation):
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, D, T], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d: weight must be [D, W] with D = x.shape[1] = {x.shape[1]}, got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"causal_conv1d: bias must be [{x.shape[1]}], got {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _conv_dense(x, weight, bias, activation, initial_state):
    """One run of sequences of equal length: x [B, D, T], state [B, D, W-1] or None."""
    batch, dim, _ = x.shape
    width = weight.shape[1]
    xf = _acc(x)
    if initial_state is None:
        state = xf.new_zeros(batch, dim, width - 1)
    else:
        if tuple(initial_state.shape) != (batch, dim, width - 1):
            raise ValueError(
                f"causal_conv1d: initial_state must be [{batch}, {dim}, {width - 1}], got {tuple(initial_state.shape)}"
            )
        state = _acc(initial_state)
    if x.shape[-1] == 0:  # an empty sequence (a zero-length packed segment): no output, the state passes through
        return x.new_empty(batch, dim, 0), state
    xpad = torch.cat([state, xf], dim=-1)  # [B, D, W-1+T]
    out = F.conv1d(xpad, _acc(weight).to(xpad.dtype).unsqueeze(1), None if bias is None else _acc(bias).to(xpad.dtype), groups=dim)
    if activation is not None:
        out = F.silu(out)
    final_state = xpad[..., xpad.shape[-1] - (width - 1):]
    return out.to(x.dtype), final_state


@torch.compiler.disable
def _conv_packed(x, weight, bias, activation, initial_state, return_final_state, cu_seqlens):
    """The dense conv per packed sequence, its bounds read on the host. Eager under torch.compile (a hybrid
    model's Mamba2 layers with `parallel.compile`): traced, the host read would break the graph and the bounds,
    new with every packed batch, would be constants of the code after it, compiled again at every step."""
    bounds = [int(v) for v in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != x.shape[-1] or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(
            f"causal_conv1d: cu_seqlens must rise from 0 to T={x.shape[-1]}, got {bounds}"
        )
    num_seqs = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != num_seqs:
        raise ValueError(
            f"causal_conv1d: packed initial_state needs one row per sequence ({num_seqs}), got {initial_state.shape[0]}"
        )
    outs, finals = [], []
    for i in range(num_seqs):
        start, end = bounds[i], bounds[i + 1]
        state = None if initial_state is None else initial_state[i : i + 1]
        out, final_state = _conv_dense(x[..., start:end], weight, bias, activation, state)
        outs.append(out)
        finals.append(final_state)
    out = torch.cat(outs, dim=-1)
    return (out, torch.cat(finals, dim=0)) if return_final_state else out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: Optional[str] = "silu",
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Causal depthwise conv1d (see module docstring for layouts).

    Returns `out [B, D, T]` in x's dtype, or `(out, final_state)` when `return_final_state`; the
    final state is fp32 (it holds raw inputs, so keeping it fp32 loses nothing on the next step).
    """
    _check_inputs(x, weight, bias, activation)
    if cu_seqlens is None:
        out, final_state = _conv_dense(x, weight, bias, activation, initial_state)
        return (out, final_state) if return_final_state else out

    if x.shape[0] != 1:
        raise ValueError(f"causal_conv1d: packed input (cu_seqlens) needs batch 1, got batch {x.shape[0]}")
    return _conv_packed(x, weight, bias, activation, initial_state, return_final_state, cu_seqlens)
