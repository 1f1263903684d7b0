"""`ssd_chunk_scan` and `ssd_state_update` on mamba-ssm's Triton kernels (state-spaces/mamba), chosen by
`auto` on CUDA when the package is installed (experimental: not yet run on a GPU).

Our contract (kernels/reference/ssd.py) was written in the shapes of
`mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias,
initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit, return_final_states, return_varlen_states)`
and `mamba_ssm.ops.triton.selective_state_update.selective_state_update(state, x, dt, A, B, C, D, z,
dt_bias, dt_softplus)`. What the adapter translates, and where it falls back to the reference (logged
once per reason):

- packed sequences are `seq_idx` `[1, T]` int32 built from `cu_seqlens`; their per-sequence final states
  come from `return_varlen_states` (with `cu_seqlens`), which has no backward in mamba-ssm -> a packed
  call that wants final states while gradients are recorded runs the reference;
- `initial_states` are per batch row there: packed calls with per-sequence initial states run the
  reference;
- `selective_state_update` takes per-channel parameters: A `[H, P, N]`, dt `[B, H, P]`, dt_bias and D
  `[H, P]` — ours are per head, so they are expanded (stride-0 views, no copy, as mamba-ssm's own Mamba2
  decoding step does); it has no `dt_limit` clamp -> with a limit (Nemotron-H's (time_step_min, inf)) dt is
  discretised here (dt + dt_bias, softplus, clamp, in fp32: the reference's `_discretize_dt`) and passed
  without bias or softplus;
- dtypes fp32 / fp16 / bf16; final states are returned in fp32 as the reference does.

Tested on the CPU against stand-ins of these two functions (tests/unit/kernels/test_thirdparty_mamba_ssm.py) and
against mamba-ssm 2.3.2's own Triton kernels run by Triton's interpreter (test_thirdparty_mamba_ssm_real.py: the
scan forward and backward, batched and packed, states, decoding; fp32 and fp16). Not yet compiled on a GPU.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Optional

import torch

from ..reference import ssd as reference
from .causal_conv1d import _records_grad, seq_idx_from_cu_seqlens

logger = logging.getLogger("megatron_vlm.kernels")
logger.info("kernels: mamba-ssm backend loaded (experimental: not yet run on a GPU)")  # imported when first chosen
_logged: set = set()
_NO_LIMIT = (0.0, math.inf)


def _fallback(op: str, reason: str):
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.info("%s: backend mamba_ssm falls back to the torch reference: %s", op, reason)
    return getattr(reference, op)


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
    dt_limit: Sequence[float] = _NO_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Public-signature chunked SSD scan on `mamba_chunk_scan_combined` (contract: the reference)."""
    args = (x, dt, A, B, C)
    kwargs = dict(chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                  initial_states=initial_states, return_final_states=return_final_states, cu_seqlens=cu_seqlens)
    packed = cu_seqlens is not None
    if packed and initial_states is not None:
        return _fallback("ssd_chunk_scan", "packed sequences with initial states (per batch row only there)")(*args, **kwargs)
    if packed and return_final_states and _records_grad(x, dt, A, B, C, D, z, dt_bias):
        return _fallback("ssd_chunk_scan", "per-sequence final states of a packed call have no backward there")(
            *args, **kwargs)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    seq_idx = None
    if packed:
        if x.shape[0] != 1:
            raise ValueError(f"ssd_chunk_scan: packed input (cu_seqlens) needs batch 1, got batch {x.shape[0]}")
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens.to(x.device), x.shape[1])
    out = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
        cu_seqlens=cu_seqlens.to(x.device, torch.int32) if packed and return_final_states else None,
        dt_softplus=dt_softplus, dt_limit=tuple(float(v) for v in dt_limit),
        return_final_states=return_final_states and not packed, return_varlen_states=packed and return_final_states,
    )
    if not return_final_states:
        return out
    y, final = out
    return y, final.float()


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
    dt_limit: Sequence[float] = _NO_LIMIT,
) -> torch.Tensor:
    """Public-signature decoding step on `selective_state_update` (updates `state` in place)."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    if tuple(float(v) for v in dt_limit) != _NO_LIMIT:
        # the kernel has no clamp: dt is discretised here as the reference does it (dt + dt_bias, softplus, clamp;
        # fp32, [B, H]) and handed over as final (no bias, no softplus), which the kernel then uses as is
        dt = reference._discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
        dt_bias, dt_softplus = None, False

    batch, heads, headdim = x.shape
    dstate = state.shape[-1]
    # D and dt_bias are given even when absent (zeros: exact): mamba-ssm 2.3's wrapper reads dt_bias.stride() and
    # unpacks D's strides without a None check, so None fails there (found running its code in the interpreter)
    zeros = torch.zeros(heads, device=x.device, dtype=torch.float32)
    D = zeros if D is None else D
    dt_bias = zeros if dt_bias is None else dt_bias
    return selective_state_update(
        state, x, dt[:, :, None].expand(batch, heads, headdim), A[:, None, None].expand(heads, headdim, dstate), B, C,
        D=D[:, None].expand(heads, headdim) if D.dim() == 1 else D, z=z,
        dt_bias=dt_bias[:, None].expand(heads, headdim), dt_softplus=dt_softplus,
    )
