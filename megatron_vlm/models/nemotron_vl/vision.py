"""Nemotron-3-Nano-VL vision side: RADIO ViT encoder, pixel shuffle and the MLP projector.

RADIO (transformers' `RadioModel`, with the input normalisation done by the processor):
* `embeddings`: patches `[N, C*p*p]` (channel-major, row-major over the grid, as the processor
  emits them) -> `patch_projection` (no bias) + a learned position table `[1, R*R, hidden]`
  (R = max_img_size / p) bilinearly resized to the image's grid (square resize to max(gh, gw),
  then cropped) -> prefixed by `num_cls_tokens + num_registers` learned tokens. Video frames go in
  groups of `video_temporal_patch_size` stacked on the channel axis through `video_patch_projection`.
* `encoder.layer[i]`: x + ls1 * attn(LN(x)); x + ls2 * mlp(LN(x)); bidirectional attention with
  q/k/v/o biases, no rotary; each image attends only to itself (packed with `cu_seqlens`).
* features = the patch tokens (prefix dropped).
Then per image: pixel shuffle (each merge x merge block of patches -> one token with merge^2 *
hidden channels, InternVL's `pixel_shuffle` element order) and `multi_modal_projector`
(RMSNorm -> Linear -> relu^2 -> Linear, no biases).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm import kernels
from megatron_vlm.host_copies import move, on_host
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.moe import activation_fn
from megatron_vlm.models.common.norms import RMSNorm
from megatron_vlm.models.nemotron_vl.args import RadioVisionArgs


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dim, computed by `kernels.layer_norm`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


class RadioLayerScale(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.lambda1


class RadioMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act = activation_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class RadioSwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class RadioLayer(nn.Module):
    def __init__(self, args: RadioVisionArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.norm1 = LayerNorm(h, args.layer_norm_eps)
        self.attention = Attention(
            h, args.num_attention_heads, args.num_attention_heads, args.head_dim,
            qkv_bias=args.qkv_bias, o_bias=True, causal=False,
        )
        self.layer_scale1 = RadioLayerScale(h)
        self.norm2 = LayerNorm(h, args.layer_norm_eps)
        if args.use_swiglu_ffn:
            self.mlp = RadioSwiGLUMLP(h, args.mlp_hidden_size)
        else:
            self.mlp = RadioMLP(h, args.mlp_hidden_size, args.hidden_act)
        self.layer_scale2 = RadioLayerScale(h)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """x packed `[T, hidden]`, one segment per image in `cu_seqlens`."""
        # RADIO has absolute position embeddings and no rotary: cos / sin None skip it
        x = x + self.layer_scale1(self.attention(self.norm1(x), None, None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class RadioEmbeddings(nn.Module):
    def __init__(self, args: RadioVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.max_grid = args.max_img_size // args.patch_size
        patch_dim = args.num_channels * args.patch_size**2
        self.patch_projection = nn.Linear(patch_dim, args.hidden_size, bias=False)
        if args.video_temporal_patch_size is not None:
            self.video_patch_projection = nn.Linear(args.video_temporal_patch_size * patch_dim, args.hidden_size, bias=False)
        else:
            self.video_patch_projection = None
        self.position_embedding = nn.Parameter(torch.zeros(1, self.max_grid * self.max_grid, args.hidden_size))
        self.cls_register_token = nn.Parameter(torch.zeros(args.num_prefix_tokens, args.hidden_size))

    def positions(self, grid_h: int, grid_w: int, dtype: torch.dtype) -> torch.Tensor:
        """Position table resized to a (grid_h, grid_w) grid: `[grid_h * grid_w, hidden]` (row-major)."""
        table = self.position_embedding.reshape(1, self.max_grid, self.max_grid, -1).permute(0, 3, 1, 2).float()
        side = max(grid_h, grid_w)
        table = F.interpolate(table, size=(side, side), mode="bilinear", align_corners=False)
        table = table[..., :grid_h, :grid_w]
        return table.flatten(2)[0].t().to(dtype)

    def embed(self, patches: torch.Tensor, grids: list[tuple[int, int]], projection: nn.Linear) -> torch.Tensor:
        """patches `[sum(gh*gw), patch_dim]` -> packed sequences `[sum(prefix + gh*gw), hidden]`."""
        x = projection(patches)
        pieces = []
        for (gh, gw), part in zip(grids, x.split([gh * gw for gh, gw in grids])):
            pieces.extend([self.cls_register_token.to(x.dtype), part + self.positions(gh, gw, x.dtype)])
        return torch.cat(pieces)


def frames_to_patches(frames: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[B, C, H, W]` -> `[B * rows * cols, C * p * p]` (row-major patches, channel-major inside a patch)."""
    b, c, h, w = frames.shape
    rows, cols = h // patch_size, w // patch_size
    patches = frames.reshape(b, c, rows, patch_size, cols, patch_size).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b * rows * cols, c * patch_size * patch_size)


class RadioVisionModel(nn.Module):
    def __init__(self, args: RadioVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = RadioEmbeddings(args)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(RadioLayer(args) for _ in range(args.num_hidden_layers))

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.layer

    def _encode(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        prefix = self.args.num_prefix_tokens
        lengths = [prefix + gh * gw for gh, gw in grids]
        cu_seqlens = move(F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32), x.device)  # no sync
        max_seqlen = max(lengths)
        for layer in self.encoder.layer:
            x = layer(x, cu_seqlens, max_seqlen)
        # the patch rows (not the prefix tokens) by position, made on the host: a bool mask would read its count
        keep, start = [], 0
        for n in lengths:
            keep.append(torch.arange(start + prefix, start + n))
            start += n
        return x.index_select(0, torch.cat(keep).to(x.device, non_blocking=True))

    def forward(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> torch.Tensor:
        """Images: pixel_values `[total_patches, C*p*p]`, image_grid_hw `[n, 2]` -> patch features `[total_patches, hidden]`."""
        grids = [tuple(g) for g in on_host(image_grid_hw).tolist()]  # the host copy: no device sync
        total = sum(gh * gw for gh, gw in grids)
        if pixel_values.dim() != 2 or pixel_values.shape[0] != total:
            raise ValueError(
                f"vision tower: pixel_values has shape {tuple(pixel_values.shape)}, but image_grid_hw "
                f"{image_grid_hw.tolist()} describes {total} patches"
            )
        x = self.embeddings.embed(pixel_values, grids, self.embeddings.patch_projection)
        return self._encode(x, grids)

    def forward_video(self, frames: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Video frames `[F, C, H, W]` -> (features `[groups * gh * gw, hidden]`, gh, gw); frames are taken in
        groups of `video_temporal_patch_size` (the last frame repeated to fill the final group)."""
        proj = self.embeddings.video_patch_projection
        if proj is None:
            raise ValueError("vision tower: video input needs vision_config.video_temporal_patch_size")
        t = self.args.video_temporal_patch_size
        num, c, h, w = frames.shape
        if num % t:
            frames = torch.cat([frames, frames[-1:].expand(t - num % t, -1, -1, -1)])
        packed = frames.reshape(frames.shape[0] // t, t * c, h, w)
        gh, gw = h // self.args.patch_size, w // self.args.patch_size
        grids = [(gh, gw)] * packed.shape[0]
        x = self.embeddings.embed(frames_to_patches(packed, self.args.patch_size), grids, proj)
        return self._encode(x, grids), gh, gw


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """`[B, gh, gw, C]` -> `[B, gh*scale, gw*scale, C/scale^2]` in InternVL / Nemotron-VL element order."""
    b, gh, gw, c = features.shape
    x = features.reshape(b, gh, int(gw * scale), int(c / scale))
    x = x.transpose(1, 2).reshape(b, int(gw * scale), int(gh * scale), int(c / scale**2))
    return x.transpose(1, 2).contiguous()


class NemotronVLProjector(nn.Module):
    """RMSNorm -> linear_1 -> relu^2 -> linear_2 (names as transformers' multi_modal_projector)."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.layer_norm = RMSNorm(input_size, eps=eps)
        self.linear_1 = nn.Linear(input_size, hidden_size, bias=False)
        self.linear_2 = nn.Linear(hidden_size, output_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.square(F.relu(self.linear_1(self.layer_norm(x)))))


def shuffle_and_project(
    features: torch.Tensor,
    grids: list[tuple[int, int]],
    downsample_ratio: float,
    projector: NemotronVLProjector,
    final_norm: Optional[nn.Module] = None,
) -> torch.Tensor:
    """Per-image pixel shuffle of `[sum(gh*gw), hidden]` features, then the projector -> `[sum(gh*gw)*r^2, out]`."""
    if final_norm is not None:
        features = final_norm(features)
    merge = int(round(1 / downsample_ratio))
    shuffled = []
    for (gh, gw), part in zip(grids, features.split([gh * gw for gh, gw in grids])):
        if gh % merge or gw % merge:
            raise ValueError(f"image grid {(gh, gw)}: both sides must be multiples of the merge size {merge}")
        shuffled.append(pixel_shuffle(part.reshape(1, gh, gw, -1), downsample_ratio).reshape(-1, part.shape[-1] * merge**2))
    return projector(torch.cat(shuffled))
