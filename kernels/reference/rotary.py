"""Reference rotary position embedding with per-token cos / sin.

Layout contract (shared by every backend):

* x is `[..., T, H, D]`: packed `[T, H, D]` or batched `[B, S, H, D]` (heads on the second-to-last
  dim; transformers' `[B, H, S, D]` must be transposed first).
* cos / sin are per token, without the head dim: `[..., T, C]`, broadcastable against x after a
  head dim is inserted (`cos.unsqueeze(-2)`), e.g. `[T, C]`, `[S, C]` or `[B, S, C]`. Because they are
  per token, M-RoPE (Qwen2.5-VL / Qwen3-VL: cos assembled from t/h/w sections) and the 2-D rotary of
  the vision towers reuse the same op.
* Full width (default): C == D_rot, the transformers layout: for `interleaved=False` (rotate_half,
  GPT-NeoX / Qwen convention) the pair (i, i + D_rot/2) is rotated by angle cos[i]/sin[i] for the
  first element and cos[i + D_rot/2] for the second (transformers builds cos = cat(f, f), so the two
  halves are equal); for `interleaved=True` (GPT-J convention) the pair (2i, 2i+1) is rotated.
  The formula used is exactly out = x * cos + rotate(x) * sin, element by element.
* Half width: pass `rotary_dim=D_rot` and cos / sin with C == D_rot / 2 (the flash-attn layout, one
  angle per pair); they are expanded to full width (cat(c, c), or repeat_interleave for interleaved).
* D_rot <= D; the tail x[..., D_rot:] passes through unchanged (partial rotary).
* cos / sin are constants: no gradient flows to them. Computed in fp32, returned in x's dtype.
"""
from typing import Optional

import torch


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """`torch.broadcast_shapes(shape, target) == target`, in plain Python: this check runs for every
    rotary call (twice per layer and decode step), and the torch helper costs more than the rotation of
    a decode step's few rows."""
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def expand_cos_sin(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotary_dim: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the layout contract and return full-width cos / sin `[..., T, 1, D_rot]`."""
    if x.dim() < 3:
        raise ValueError(f"apply_rotary: x must be [..., T, H, D], got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rotary: cos shape {tuple(cos.shape)} != sin shape {tuple(sin.shape)}")
    head_dim, width = x.shape[-1], cos.shape[-1]
    d_rot = width if rotary_dim is None else rotary_dim
    if width not in (d_rot, d_rot // 2) or d_rot % 2 or d_rot > head_dim or d_rot <= 0:
        raise ValueError(
            f"apply_rotary: cos last dim {width} with rotary_dim={rotary_dim} does not fit head dim {head_dim} "
            "(need full width C == rotary_dim <= D, or half width C == rotary_dim / 2, rotary_dim even)"
        )
    if width == d_rot // 2 and rotary_dim is not None and width != d_rot:
        if interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if not _broadcasts_to(tuple(cos.shape), tuple(x.shape[:-1]) + (d_rot,)):
        raise ValueError(
            f"apply_rotary: cos/sin {tuple(cos.shape[:-2]) + (cos.shape[-1],)} do not broadcast against x "
            f"{tuple(x.shape)} (cos/sin must be [..., T, C] matching x's [..., T] dims)"
        )
    return cos, sin


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """rotate_half (x1, x2) -> (-x2, x1), or for interleaved pairs (a, b) -> (-b, a)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([-b, a], dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
) -> torch.Tensor:
    """Rotate the first D_rot features of every head of x by per-token angles (see module docstring)."""
    cos, sin = expand_cos_sin(x, cos, sin, interleaved, rotary_dim)
    d_rot = cos.shape[-1]
    xr = x[..., :d_rot].float()
    out = xr * cos.float() + rotate(xr, interleaved) * sin.float()
    if d_rot < x.shape[-1]:
        out = torch.cat([out, x[..., d_rot:].float().expand(out.shape[:-1] + (x.shape[-1] - d_rot,))], dim=-1)
    return out.to(x.dtype)
