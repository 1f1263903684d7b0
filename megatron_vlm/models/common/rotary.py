"""Rotary angle tables: 1-D RoPE, M-RoPE (3-D t/h/w sections, chunked or interleaved) and the 2-D
rotary of vision towers; `decoder_rope_cos_sin` picks 1-D or M-RoPE for the shared Qwen decoders.

All functions return per-token `(cos, sin)` of width `head_dim` in the rotate-half layout
(`cat(f, f)`), which is what `megatron_vlm.kernels.apply_rotary` takes for `x` laid out
`[..., T, H, D]`. Angles are computed in fp32 from integer positions on the fly (no buffers): the
cost is negligible next to attention, and a module built on the meta device needs no re-init.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def rope_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/dim), i < dim/2 (fp32), the standard RoPE frequencies."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def _rotate_half_cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., 2F] of angles `freqs` [..., F], duplicated for the rotate-half layout."""
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D RoPE: position_ids [...] -> cos, sin [..., head_dim] (fp32)."""
    freqs = position_ids[..., None].float() * rope_inv_freq(head_dim, theta, position_ids.device)
    return _rotate_half_cos_sin(freqs)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: Sequence[int],
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE: position_ids [3, ...] (temporal, height, width) -> cos, sin [..., head_dim] (fp32).

    Chunked (Qwen2-VL / Qwen2.5-VL, default): the head_dim/2 frequencies are split into
    `mrope_section` = (s_t, s_h, s_w) consecutive chunks; chunk j takes its angle from position row j.
    Interleaved (Qwen3-VL): frequency i takes row 1 (height) when i % 3 == 1 and i < 3 * s_h, row 2
    (width) when i % 3 == 2 and i < 3 * s_w, and row 0 (temporal) otherwise, so every axis spans low
    and high frequencies. Text tokens have equal rows, so both reduce to plain RoPE there.
    """
    if position_ids.shape[0] != 3:
        raise ValueError(f"mrope_cos_sin: position_ids must be [3, ...], got {tuple(position_ids.shape)}")
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_cos_sin: mrope_section {list(mrope_section)} does not sum to head_dim/2 = {head_dim // 2}")
    freqs = position_ids[..., None].float() * rope_inv_freq(head_dim, theta, position_ids.device)  # [3, ..., D/2]
    if interleaved:
        idx = torch.arange(head_dim // 2, device=position_ids.device)
        row = torch.zeros_like(idx)  # torch.where: a bool-mask assignment would read the mask's count (a sync)
        row = torch.where((idx % 3 == 1) & (idx < 3 * mrope_section[1]), 1, row)
        row = torch.where((idx % 3 == 2) & (idx < 3 * mrope_section[2]), 2, row)
        freqs = freqs.gather(0, row.expand(freqs.shape[1:]).unsqueeze(0)).squeeze(0)  # [..., D/2]
    else:
        chunks = freqs.split(list(mrope_section), dim=-1)
        freqs = torch.cat([chunk[j] for j, chunk in enumerate(chunks)], dim=-1)  # [..., D/2]
    return _rotate_half_cos_sin(freqs)


def vision_rope_cos_sin(hw_position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary of the Qwen vision towers: hw_position_ids [N, 2] (row, column) -> cos, sin [N, head_dim].

    head_dim/4 frequencies (RoPE over dim head_dim/2) are applied to the row index and the same
    frequencies to the column index; the two halves are concatenated and then duplicated for the
    rotate-half layout.
    """
    if hw_position_ids.dim() != 2 or hw_position_ids.shape[-1] != 2:
        raise ValueError(f"vision_rope_cos_sin: positions must be [N, 2], got {tuple(hw_position_ids.shape)}")
    inv_freq = rope_inv_freq(head_dim // 2, theta, hw_position_ids.device)  # [head_dim/4]
    freqs = hw_position_ids[..., None].float() * inv_freq  # [N, 2, head_dim/4]
    freqs = freqs.flatten(1)  # [N, head_dim/2]: h frequencies then w frequencies
    return _rotate_half_cos_sin(freqs)


def decoder_rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: Optional[Sequence[int]],
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary of the Qwen language decoders, shared by the VLMs and the text-only models.

    `mrope_section` given (Qwen2.5-VL / Qwen3-VL): M-RoPE, position_ids [3, B, T]. None (text-only
    Qwen2 / Qwen3): 1-D RoPE, position_ids [B, T]. Returns cos, sin [B, T, head_dim] (fp32)."""
    if mrope_section is not None:
        return mrope_cos_sin(position_ids, head_dim, theta, mrope_section, interleaved=interleaved)
    if position_ids.dim() != 2:
        raise ValueError(f"1-D RoPE: position_ids must be [B, T], got {tuple(position_ids.shape)}")
    return rope_cos_sin(position_ids, head_dim, theta)
