"""Building blocks of the Qwen-style vision towers (Qwen2.5-VL, reused by later Qwen families).

* `VisionPatchEmbed`: the Conv3d patchifier (bias optional) written as the Linear it is (stride == kernel), over
  the processor's flattened patches `[N, C * temporal_patch * patch * patch]` (channel-major, the
  Conv3d weight flattening order). The state-dict adapter reshapes the HF Conv3d weight.
* `VisionBlock`: pre-norm ViT block: RMSNorm -> bidirectional attention (2-D rotary, per-segment
  `cu_seqlens`) -> residual -> RMSNorm -> SwiGLU MLP with bias -> residual.
* index helpers computed from `grid_thw` ([num_items, 3] = frames, patch rows, patch columns):
  per-patch (row, column) for the 2-D rotary, per-frame `cu_seqlens` for full attention, and the
  window permutation + `cu_window_seqlens` for window attention. The grids are read from their host copy
  (megatron_vlm/host_copies.py) and the index tensors built on the host and moved without waiting, keeping their host
  copy (the attention's longest segment is read from it): no device sync.

Patch order: the processor emits the patches of each frame in spatial-merge blocks (the m x m
patches merged into one LLM token are consecutive), frames in order, items in order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.host_copies import move, on_host
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.norms import RMSNorm


def _check_grid(grid_thw: torch.Tensor, spatial_merge_size: int) -> list[list[int]]:
    if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
        raise ValueError(f"grid_thw must be [num_items, 3], got {tuple(grid_thw.shape)}")
    grids = on_host(grid_thw).tolist()
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h % spatial_merge_size or w % spatial_merge_size or h < 1 or w < 1:
            raise ValueError(
                f"grid_thw[{i}] = {[t, h, w]}: t must be >= 1 and h, w positive multiples of spatial_merge_size "
                f"{spatial_merge_size}"
            )
    return grids


def vision_hw_position_ids(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(row, column) of every patch, in the processor's merge-block order: [N, 2] long."""
    out = []
    m = spatial_merge_size
    for t, h, w in _check_grid(grid_thw, m):
        rows = torch.arange(h, device=grid_thw.device).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
        cols = torch.arange(w, device=grid_thw.device).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
        frame = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
        out.append(frame.repeat(t, 1))
    return torch.cat(out, dim=0)


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative patch counts with one segment per frame (full attention never crosses frames): int32, on the
    grid's device, with its host copy."""
    grid = on_host(grid_thw)
    per_frame = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return move(F.pad(per_frame.cumsum(0, dtype=torch.int32), (1, 0)), grid_thw.device)


def vision_window_index(
    grid_thw: torch.Tensor, spatial_merge_size: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window permutation of the merged tokens and the window boundaries in patches.

    Each frame's merged grid (h/m x w/m) is tiled by square windows of `window_size / patch_size / m`
    merged tokens (edge windows are smaller); windows are visited row-major, tokens inside a window
    row-major. Returns `window_index` [num_merged_tokens] (long; new order -> old merged-token index)
    and `cu_window_seqlens` [num_windows + 1] (int32, in patches, i.e. merged tokens * m^2), both on the grid's
    device (built on the host: `cu_window_seqlens` keeps its host copy).
    """
    m = spatial_merge_size
    win = window_size // m // patch_size
    if win < 1:
        raise ValueError(f"window_size {window_size} is smaller than one merged token ({m} x {patch_size} pixels)")
    index, seqlens, offset = [], [], 0
    for t, h, w in _check_grid(grid_thw, m):
        lh, lw = h // m, w // m
        rows = torch.arange(lh).view(lh, 1)
        cols = torch.arange(lw).view(1, lw)
        n_win_w = -(-lw // win)
        window_id = ((rows // win) * n_win_w + cols // win).reshape(-1)
        order = torch.argsort(window_id, stable=True)  # row-major inside each window
        counts = torch.bincount(window_id)
        counts = counts[counts > 0]
        frame_tokens = lh * lw
        for f in range(t):
            index.append(order + offset + f * frame_tokens)
            seqlens.append(counts)
        offset += t * frame_tokens
    device = grid_thw.device
    cu = F.pad(torch.cat(seqlens).cumsum(0) * (m * m), (1, 0)).to(torch.int32)
    return torch.cat(index).to(device, non_blocking=True), move(cu, device)


class VisionPatchEmbed(nn.Module):
    """Linear patchifier: [N, C * T_p * P * P] -> [N, hidden]."""

    def __init__(
        self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden_size: int, *, bias: bool = False
    ) -> None:
        super().__init__()
        self.patch_dim = in_channels * temporal_patch_size * patch_size * patch_size
        self.proj = nn.Linear(self.patch_dim, hidden_size, bias=bias)  # Qwen2.5-VL: no bias; Qwen3-VL: bias

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-1] != self.patch_dim:
            pixel_values = pixel_values.reshape(-1, self.patch_dim)
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionBlock(nn.Module):
    """Pre-norm ViT block with bidirectional attention over `cu_seqlens` segments."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        head_dim = hidden_size // num_heads
        self.norm1 = RMSNorm(hidden_size, eps=norm_eps)
        self.attn = Attention(hidden_size, num_heads, num_heads, head_dim, qkv_bias=True, o_bias=True, causal=False)
        self.norm2 = RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        attn_out = self.attn(self.norm1(x), cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        normed, x = self.norm2(attn_out, residual=x)  # fused residual add + norm
        return x + self.mlp(normed)
