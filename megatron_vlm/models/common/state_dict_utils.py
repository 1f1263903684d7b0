"""Helpers shared by the families' state-dict adapters: splitting and joining fused q/k/v tensors,
and applying regex rename tables to keys.

Fused QKV lives in the adapters, never in model code (attention keeps separate q/k/v projections,
which tensor parallelism shards column-wise); every family with a fused vision qkv (Qwen2.5-VL,
Qwen3-VL, InternViT, C-RADIO) splits it on import and joins it on export the same way:
rows stacked q, k, v along dim 0 (weight [3 * out, in], bias [3 * out]).
"""
from __future__ import annotations

import re
from typing import Iterator, Optional, Sequence

import torch

RenameTable = Sequence[tuple[str, str]]
QKV = ("q", "k", "v")


def split_fused_qkv(key: str, t: torch.Tensor, *, rows: Optional[int] = None) -> dict[str, torch.Tensor]:
    """{"q", "k", "v"} -> the three row blocks of a fused tensor; `rows` = each block's row count
    (None: equal thirds). `key` names the checkpoint tensor in the error."""
    if rows is None:
        if t.shape[0] % 3:
            raise ValueError(f"{key}: fused qkv has {t.shape[0]} rows, not a multiple of 3")
        parts = t.chunk(3, dim=0)
    else:
        if t.shape[0] != 3 * rows:
            raise ValueError(f"{key}: fused qkv has {t.shape[0]} rows, expected 3 x {rows}")
        parts = t.split(rows, dim=0)
    return dict(zip(QKV, parts))


def join_fused_qkv(
    groups: dict[tuple[str, str], dict[str, torch.Tensor]], owner: str
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(layer, kind, fused tensor) per collected group, in layer order. `groups[(layer, kind)]` maps
    "q" / "k" / "v" to the separate tensors; `owner` (formatted with `layer`) names an incomplete group."""
    for (layer, kind), parts in sorted(groups.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        if set(parts) != set(QKV):
            missing = sorted(set(QKV) - set(parts))
            raise ValueError(f"{owner.format(layer=layer)}: missing {missing}_proj.{kind}")
        yield layer, kind, torch.cat([parts[n] for n in QKV], dim=0)


def rename_all(key: str, table: RenameTable) -> str:
    """Apply every (pattern, replacement) of `table` in order."""
    for pattern, repl in table:
        key = re.sub(pattern, repl, key)
    return key


def rename_first(key: str, table: RenameTable) -> Optional[str]:
    """The key rewritten by the first pattern of `table` that matches it, or None."""
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    return None
