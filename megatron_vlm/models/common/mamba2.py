"""Mamba2 mixer (selective state space layer) with a decoding state, as in NemotronH / Mamba2.

    in_proj(x) = [z (I) | xBC (I + 2*G*N) | dt (H)]      I = H * P inner size, G groups, N state size
    xBC = silu(causal_conv1d(xBC))  ->  x (I), B (G*N), C (G*N)
    y   = SSD scan(x, dt, A = -exp(A_log), B, C, D, dt_bias)      (kernels.ssd_chunk_scan)
    out = out_proj(GatedRMSNorm(y, z))                    norm of y * silu(z), per group of I / G channels

Parameter names and shapes are transformers' `NemotronHMamba2Mixer` (in_proj, conv1d, dt_bias,
A_log, D, norm.weight, out_proj) so checkpoints map one to one. Inputs are batched `[B, T, hidden]`
with an optional padding mask (padding positions are zeroed before the projection and after the
convolution, so left padding leaves the state untouched) or packed `[1, T, hidden]` with
`cu_seqlens` (the state restarts at every sample). Decoding passes a `Mamba2State` (conv state =
last W-1 conv inputs, SSM state `[B, H, P, N]` fp32) that the call updates in place: prefill with
T > 1 tokens, then one token per step; stepping equals the full forward.

dt is clamped below at `time_step_min` in both the scan and the step (transformers clamps only in
its chunked path; the clamp keeps our decoding equal to our forward).

Tensor parallelism (`tp_size` > 1, set by `parallel.tensor_parallel.apply_tp`): as in Megatron, each tp
rank runs a contiguous block of `num_heads / tp` heads and their `n_groups / tp` B / C groups: the rows of
in_proj for its z / x / B / C / dt, the same conv channels, its heads' A / D / dt_bias, its groups of the
gated norm (the norm is per group, so no communication) and the matching columns of out_proj, whose
output is a partial sum over the tp ranks (bias added by rank 0 only). The parameters keep their
whole (checkpoint) shapes on every tp rank: in_proj's rows interleave the z | xBC | dt segments, so a
contiguous row split would not be a head split; each rank selects its rows and the gradients, non-zero
only on a rank's rows, are summed over the tp ranks. The decoding state holds the local heads. A LoRA
adapter on in_proj / out_proj (`LoRALinear`) is split the same way: its B's rows of the rank's heads for
in_proj (A whole: the input is), its A's columns of the rank's channels for out_proj (B whole: the update
is a partial sum like the base output); its factors' gradients are summed over the tp ranks too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.models.common.lora import LoRAAdapter


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate) computed per group of `group_size` channels (Mamba2 `norm_before_gate=False`)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"GatedRMSNorm: group_size {group_size} must divide hidden_size {hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`weight`: the channels' slice of `self.weight` when x holds only some groups (tensor parallelism)."""
        weight = self.weight if weight is None else weight
        dtype = x.dtype
        h = x.float()
        if gate is not None:
            h = h * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * groups.view(h.shape).to(dtype)


@dataclass
class Mamba2State:
    """Decoding state of one Mamba2 layer: conv inputs `[B, conv_dim, W-1]` and SSM state `[B, H, P, N]` (fp32)."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor

    @classmethod
    def zeros(cls, mixer: Mamba2Mixer, batch: int, device=None) -> Mamba2State:
        device = device if device is not None else mixer.A_log.device
        return cls(
            conv_state=torch.zeros(batch, mixer.conv_dim // mixer.tp_size, mixer.conv_kernel - 1, dtype=torch.float32,
                                   device=device),
            ssm_state=torch.zeros(
                batch, mixer.num_heads // mixer.tp_size, mixer.head_dim, mixer.state_size, dtype=torch.float32,
                device=device,
            ),
        )

    def repeat_interleave(self, g: int) -> Mamba2State:
        return Mamba2State(self.conv_state.repeat_interleave(g, 0), self.ssm_state.repeat_interleave(g, 0))


class Mamba2Mixer(nn.Module):
    compile_opaque = True  # the packed conv / scan read their bounds on the host, eager under torch.compile
    # (parallel/apply.py apply_compile)

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int = 4,
        chunk_size: int = 128,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        norm_eps: float = 1e-5,
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"Mamba2Mixer: n_groups {n_groups} must divide num_heads {num_heads}")
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2Mixer: activation must be silu, got {activation!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.state_size, self.n_groups, self.conv_kernel, self.chunk_size = state_size, n_groups, conv_kernel, chunk_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.dt_limit: tuple[float, float] = (time_step_min, math.inf)
        self._dt_init = (time_step_min, time_step_max, time_step_floor)

        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        # Kept as nn.Conv1d for checkpoint parity ([conv_dim, 1, W]); the forward runs kernels.causal_conv1d.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
            padding=conv_kernel - 1, bias=use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps=norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)
        self.tp_size, self.tp_rank = 1, 0  # tensor parallelism: this rank runs heads block tp_rank of tp_size

    def tp_shard(self, tp_size: int, tp_rank: int) -> None:
        """Run heads block `tp_rank` of `tp_size` (see the module docstring); raises ValueError naming a count
        `tp_size` does not divide."""
        for key, n in (("mamba_num_heads", self.num_heads), ("n_groups", self.n_groups)):
            if n % tp_size:
                raise ValueError(f"parallel.tp={tp_size} does not divide {key}={n}: every tensor-parallel rank "
                                 "must hold the same number of Mamba2 heads and groups")
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def _local_index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_proj rows, conv channels) of this tp rank's heads and groups."""
        r, tp = self.tp_rank, self.tp_size
        inner, gn = self.intermediate_size, self.n_groups * self.state_size
        il, gl, hl = inner // tp, gn // tp, self.num_heads // tp

        def span(start, n):
            return torch.arange(start + r * n, start + (r + 1) * n, device=device)

        conv = torch.cat([span(0, il), span(inner, gl), span(inner + gn, gl)])
        rows = torch.cat([span(0, il), inner + conv, span(inner + self.conv_dim, hl)])
        return rows, conv

    def _in_weights(self, device):
        """This rank's in_proj (weight, bias): whole without tp."""
        w, b = self.in_proj.weight, self.in_proj.bias
        if self.tp_size == 1:
            return w, b
        rows = self._local_index(device)[0]
        return w.index_select(0, rows), None if b is None else b.index_select(0, rows)

    def _scan_weights(self, device):
        """This rank's (conv w, b, dt_bias, A_log, D): whole without tp."""
        conv_w, conv_b = self.conv1d.weight.squeeze(1), self.conv1d.bias
        if self.tp_size == 1:
            return conv_w, conv_b, self.dt_bias, self.A_log, self.D
        conv = self._local_index(device)[1]
        hl = self.num_heads // self.tp_size
        heads = slice(self.tp_rank * hl, (self.tp_rank + 1) * hl)
        return (conv_w.index_select(0, conv), None if conv_b is None else conv_b.index_select(0, conv),
                self.dt_bias[heads], self.A_log[heads], self.D[heads])

    def _out_weights(self):
        """This rank's (norm w, out_proj w, b): whole without tp."""
        outb = self.out_proj.bias
        if self.tp_size == 1:
            return self.norm.weight, self.out_proj.weight, outb
        il = self.intermediate_size // self.tp_size
        inner = slice(self.tp_rank * il, (self.tp_rank + 1) * il)
        return self.norm.weight[inner], self.out_proj.weight[:, inner], outb if self.tp_rank == 0 else None

    @torch.no_grad()
    def reset_parameters(self, initializer_range: float = 0.02, num_layers: int = 1) -> None:
        """transformers' NemotronH init: S4D-real A, D = 1, dt_bias = softplus^-1(dt ~ logU[min, max])."""
        for lin in (self.in_proj, self.out_proj):
            nn.init.normal_(lin.weight, std=initializer_range)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.out_proj.weight.div_(math.sqrt(num_layers))
        self.conv1d.reset_parameters()
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        lo, hi, floor = self._dt_init
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(hi) - math.log(lo)) + math.log(lo)).clamp(min=floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm.weight.fill_(1.0)

    # Under "selective" checkpointing + parallel.compile, each its own checkpoint, the mixer compiled around them
    # (parallel/apply.py `_pieces`): the conv + scan eager, the projections and the gated norm traced.
    selective_pieces = {"_project": True, "_mix": False, "_output": True}

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        state: Optional[Mamba2State] = None,
    ) -> torch.Tensor:
        """x `[B, T, hidden]`; attention_mask `[B, T]` (True / 1 = real token); returns `[B, T, hidden]`."""
        if x.dim() != 3:
            raise ValueError(f"Mamba2Mixer: x must be [B, T, hidden], got {tuple(x.shape)}")
        if state is not None and cu_seqlens is not None:
            raise ValueError("Mamba2Mixer: a decoding state works with batched input, not packed cu_seqlens")
        tp = self.tp_size
        heads, inner = self.num_heads // tp, self.intermediate_size // tp
        gn = self.n_groups // tp * self.state_size
        z, xBC, dt = self._project(x, attention_mask).split([inner, inner + 2 * gn, heads], dim=-1)
        y = self._mix(xBC, dt, attention_mask, cu_seqlens, state)
        return self._output(y, z)

    def _project(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """in_proj of x (padding zeroed): [z | xBC | dt] of this rank's heads."""
        if attention_mask is not None:
            x = x * attention_mask[..., None].to(x.dtype)
        if self.tp_size == 1:  # the module is called (adapters such as LoRA may wrap it)
            return self.in_proj(x)
        in_w, in_b = self._in_weights(x.device)
        return self._tp_lora(self.in_proj, F.linear(x, in_w, in_b), x, rows=self._local_index(x.device)[0])

    def _mix(self, xBC: torch.Tensor, dt: torch.Tensor, attention_mask: Optional[torch.Tensor],
             cu_seqlens: Optional[torch.Tensor], state: Optional[Mamba2State]) -> torch.Tensor:
        """The causal conv and the SSD scan (or one decoding step): y `[B, T, inner]`."""
        batch, seqlen, _ = xBC.shape
        tp = self.tp_size
        heads, groups, inner = self.num_heads // tp, self.n_groups // tp, self.intermediate_size // tp
        gn = groups * self.state_size
        conv_w, conv_b, dt_bias, A_log, D = self._scan_weights(xBC.device)
        if state is not None:
            xBC, conv_state = kernels.causal_conv1d(
                xBC.transpose(1, 2), conv_w, conv_b, activation="silu",
                initial_state=state.conv_state, return_final_state=True,
            )
            state.conv_state.copy_(conv_state)
        else:
            xBC = kernels.causal_conv1d(xBC.transpose(1, 2), conv_w, conv_b, activation="silu", cu_seqlens=cu_seqlens)
        xBC = xBC.transpose(1, 2)
        if attention_mask is not None:
            xBC = xBC * attention_mask[..., None].to(xBC.dtype)
        xs, B, C = xBC.split([inner, gn, gn], -1)

        A = -torch.exp(A_log.float())
        ssm_kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        if state is not None and seqlen == 1:
            y = kernels.ssd_state_update(
                state.ssm_state,
                xs.view(batch, heads, self.head_dim),
                dt[:, 0],
                A,
                B.view(batch, groups, self.state_size),
                C.view(batch, groups, self.state_size),
                **ssm_kwargs,
            )
        else:
            result = kernels.ssd_chunk_scan(
                xs.reshape(batch, seqlen, heads, self.head_dim),
                dt,
                A,
                B.reshape(batch, seqlen, groups, self.state_size),
                C.reshape(batch, seqlen, groups, self.state_size),
                chunk_size=self.chunk_size,
                initial_states=None if state is None else state.ssm_state,
                return_final_states=state is not None,
                cu_seqlens=cu_seqlens,
                **ssm_kwargs,
            )
            if state is not None:
                y, final = result
                state.ssm_state.copy_(final)
            else:
                y = result
        return y.reshape(batch, seqlen, inner)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj of the gated norm of y (gate z; the model's dtype is z's, in_proj's output)."""
        norm_w, out_w, out_b = self._out_weights()
        y = self.norm(y, z, weight=norm_w).to(z.dtype)
        if self.tp_size == 1:
            return self.out_proj(y)
        inner = self.intermediate_size // self.tp_size
        return self._tp_lora(self.out_proj, F.linear(y, out_w, out_b), y, cols=slice(self.tp_rank * inner, (self.tp_rank + 1) * inner))

    @staticmethod
    def _tp_lora(lin: nn.Module, out: torch.Tensor, x: torch.Tensor, *, rows: Optional[torch.Tensor] = None,
                 cols: Optional[slice] = None) -> torch.Tensor:
        """Under tp: `out` (this rank's block of a projection) + its LoRA update's block, when `lin` is adapted:
        B's `rows` (in_proj: the rank's heads) or A's `cols` (out_proj: the rank's channels, a partial sum)."""
        if not isinstance(lin, LoRAAdapter) or not lin.lora_enabled:
            return out
        a, b = lin.lora_A.weight, lin.lora_B.weight
        a = a if cols is None else a[:, cols]
        b = b if rows is None else b.index_select(0, rows)
        delta = F.linear(F.linear(lin.lora_dropout(x.to(a.dtype)), a), b) * lin.scaling
        return out + delta.to(out.dtype)
