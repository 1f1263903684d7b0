"""`causal_conv1d` on the causal-conv1d package (Dao-AILab), chosen by `auto` on CUDA when installed
(experimental: not yet run on a GPU).

Our contract (kernels/reference/causal_conv1d.py) was written in that package's layout, so most calls
map directly onto `causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states,
final_states_out, activation)` and, for decoding steps, `causal_conv1d_update`. Its documented
constraints, and what the adapter does about them:

- widths 2 to 4 only -> other widths run the reference (logged once);
- its channel-last kernels (the only ones that take seq_idx or states) need D % 8 == 0 and x's batch / time
  strides multiples of 8 -> x is copied into that layout when it is not in it (the Mamba2 mixer's xBC view
  often is not), and calls with seq_idx or states and D % 8 != 0 run the reference (logged once); plain calls
  take an aligned channel-last x as it is and anything else channel-first;
- bias in the weight's dtype (checked there) -> cast;
- packed sequences are given as `seq_idx` `[B, T]` int32 (the sequence index of every token) with x in
  channel-last memory (stride 1 over channels) -> built from `cu_seqlens`, x re-strided;
- `seq_idx` cannot be combined with `initial_states` or `return_final_states` -> packed calls that need a
  state run the reference (logged once);
- final states are returned only for channel-last x -> x re-strided; our final state is fp32, theirs
  has x's dtype, so it is cast;
- a decoding step (one token per row, a state in and out, no gradients) runs `causal_conv1d_update(x [B, D],
  conv_state [B, D, W-1], weight, bias, activation)`, which rolls the state in place (on a copy: the caller's
  state is left as it was) and has no backward; with gradients the step takes `causal_conv1d_fn`.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..reference import causal_conv1d as reference

logger = logging.getLogger("megatron_vlm.kernels")
_WIDTHS = (2, 3, 4)
_logged: set = set()


def _fallback(reason: str, *args, **kwargs):
    if reason not in _logged:
        _logged.add(reason)
        logger.info("causal_conv1d: backend causal_conv1d falls back to the torch reference: %s", reason)
    return reference.causal_conv1d(*args, **kwargs)


_ALIGN = 8  # the package's channel-last kernels check that D and x's batch / time strides are multiples of 8


def _aligned_channel_last(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.stride(2) % _ALIGN == 0 and x.stride(0) % _ALIGN == 0


def _channel_last(x: torch.Tensor) -> torch.Tensor:
    """[B, D, T] in the package's channel-last layout (stride 1 over D, batch and time strides multiples of 8:
    its kernels refuse others), same values: x itself when it already is, else a copy. The Mamba2 mixer's xBC
    is a channel-last view whose time stride is the whole in_proj width, often not a multiple of 8. D % 8 == 0
    is checked by `causal_conv1d` before."""
    return x if _aligned_channel_last(x) else x.transpose(1, 2).contiguous().transpose(1, 2)


def _plain_layout(x: torch.Tensor) -> torch.Tensor:
    """For a call without seq_idx or states: an aligned channel-last x as it is, else channel-first (stride 1
    over T: no alignment rule), copying only when x is neither."""
    return x if _aligned_channel_last(x) or x.stride(2) == 1 else x.contiguous()


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _decode_step(x, weight, bias, initial_state, activation):
    """One token per row (rollout decoding): `causal_conv1d_update` rolls a copy of the state in place — the
    caller's state is not written, as with the other paths; x `[B, D, 1]` is given as `[B, D]`, the layout
    mamba-ssm's own decoding step uses."""
    from causal_conv1d import causal_conv1d_update

    state = initial_state.to(x.dtype, memory_format=torch.contiguous_format, copy=True)
    out = causal_conv1d_update(x[..., 0].contiguous(), state, weight.contiguous(), bias, activation=activation)
    return out.unsqueeze(-1), state.float()


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens `[n+1]` -> seq_idx `[1, total]` int32: token t belongs to sequence i when
    cu_seqlens[i] <= t < cu_seqlens[i+1]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if ids.numel() != total:
        raise ValueError(f"causal_conv1d: cu_seqlens cover {ids.numel()} tokens, x has {total}")
    return ids.to(torch.int32)[None]


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
    """Public-signature causal_conv1d on the causal-conv1d package (contract: the reference)."""
    args = (x, weight, bias)
    kwargs = dict(activation=activation, initial_state=initial_state, return_final_state=return_final_state,
                  cu_seqlens=cu_seqlens)
    if weight.dim() != 2 or weight.shape[1] not in _WIDTHS:
        return _fallback(f"width {tuple(weight.shape)[1:]} (the package supports {_WIDTHS})", *args, **kwargs)
    if cu_seqlens is not None and (initial_state is not None or return_final_state):
        return _fallback("packed sequences with a conv state (the package's seq_idx excludes states)", *args, **kwargs)
    reference._check_inputs(x, weight, bias, activation)
    if bias is not None and bias.dtype != weight.dtype:  # the package checks that they match
        bias = bias.to(weight.dtype)
    if (initial_state is not None and return_final_state and cu_seqlens is None and x.shape[-1] == 1
            and not _records_grad(x, weight, bias, initial_state)):
        return _decode_step(x, weight, bias, initial_state, activation)  # any layout, any D
    needs_channel_last = cu_seqlens is not None or initial_state is not None or return_final_state
    if needs_channel_last and x.shape[1] % _ALIGN:
        return _fallback(f"{x.shape[1]} channels with packed sequences or a conv state (the package's channel-last "
                         f"kernels, which those need, take multiples of {_ALIGN})", *args, **kwargs)
    from causal_conv1d import causal_conv1d_fn

    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv1d: packed input (cu_seqlens) needs batch 1, got batch {x.shape[0]}")
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[-1])
        return causal_conv1d_fn(_channel_last(x), weight, bias, seq_idx=seq_idx, activation=activation)
    if not return_final_state:
        state = None if initial_state is None else _channel_last(initial_state.to(x.dtype))
        xin = _plain_layout(x) if state is None else _channel_last(x)
        return causal_conv1d_fn(xin, weight, bias, initial_states=state, activation=activation)
    state = None if initial_state is None else _channel_last(initial_state.to(x.dtype))
    out, final = causal_conv1d_fn(_channel_last(x), weight, bias, initial_states=state, return_final_states=True,
                                  activation=activation)
    return out, final.float()
