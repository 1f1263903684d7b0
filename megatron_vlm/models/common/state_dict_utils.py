"""Helpers shared by the families' state-dict adapters: splitting and joining fused q/k/v tensors,
and applying regex rename tables to keys.

Fused QKV lives in the adapters, never in model code (attention keeps separate q/k/v projections,
which tensor parallelism shards column-wise); every family with a fused vision qkv (Qwen2.5-VL,
Qwen3-VL, InternViT, C-RADIO) splits it on import and joins it on export the same way:
rows stacked q, k, v along dim 0 (weight [3 * out, in], bias [3 * out]).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Optional

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


class StateDictAdapter:
    """Base of the family adapters whose checkpoint tensors each convert on their own (`from_hf` leaves nothing
    pending between shards): the loop over the tensors, the fused vision qkv, the rotary buffers and the tied
    lm_head, written once.

    A family converts every other tensor in `_from_hf_one(key, normalised key, t)` / `_to_hf_one(our key, t)`
    (each returns a dict of converted tensors) and describes its fused qkv, if it has one: `_hf_qkv` (regex on
    the normalised HF key: layer, kind), `_ours_qkv` (our three keys: `{layer}`, `{name}`, `{kind}`) and, when it
    exports it fused, `_our_qkv` (regex on our keys: layer, name, kind), `_hf_qkv_key` and `_qkv_owner` (names an
    incomplete group in the error). `_lm_head` is the normalised HF key of the lm_head (dropped when tied)."""

    _hf_qkv: Optional[re.Pattern] = None
    _ours_qkv = ""
    _our_qkv: Optional[re.Pattern] = None
    _hf_qkv_key = ""
    _qkv_owner = ""
    _lm_head = "lm_head.weight"

    def __init__(self, args) -> None:
        self.args = args

    def normalize_hf_key(self, key: str) -> str:
        return key

    def is_ignored(self, key: str) -> bool:
        k = self.normalize_hf_key(key)
        return k.endswith("rotary_emb.inv_freq") or (self.args.tie_word_embeddings and k == self._lm_head)

    def _qkv_rows(self) -> Optional[int]:
        """Rows of each of q, k, v in a fused tensor (None: equal thirds)."""
        return None

    def _from_hf_one(self, key: str, k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _to_hf_one(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_hf(self, hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Map HF tensors to ours; returns (converted, pending) - pending is always empty here."""
        out: dict[str, torch.Tensor] = {}
        for key, t in hf.items():
            if self.is_ignored(key):
                continue
            k = self.normalize_hf_key(key)
            m = self._hf_qkv.match(k) if self._hf_qkv is not None else None
            if m:
                layer, kind = m.groups()
                for name, part in split_fused_qkv(key, t, rows=self._qkv_rows()).items():
                    out[self._ours_qkv.format(layer=layer, name=name, kind=kind)] = part
            else:
                out.update(self._from_hf_one(key, k, t))
        return out, {}

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF tensors (the lm_head left out when tied, the vision qkv fused)."""
        out: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for key, t in state_dict.items():
            m = self._our_qkv.match(key) if self._our_qkv is not None else None
            if m:
                layer, name, kind = m.groups()
                qkv.setdefault((layer, kind), {})[name] = t
            elif not (key == "lm_head.weight" and self.args.tie_word_embeddings):
                out.update(self._to_hf_one(key, t))
        for layer, kind, fused in join_fused_qkv(qkv, self._qkv_owner):
            out[self._hf_qkv_key.format(layer=layer, kind=kind)] = fused
        return out


class QwenVisionAdapter(StateDictAdapter):
    """`StateDictAdapter` for the Qwen-VL vision towers (Qwen2.5-VL, Qwen3-VL): their fused
    `visual.blocks.{i}.attn.qkv` split on import and joined on export, and the patch embedding stored as a
    Conv3d [E, C, T, P, P] in the checkpoints and held as a Linear [E, C*T*P*P] here (same element order)."""

    _hf_qkv = re.compile(r"^visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
    _ours_qkv = "visual.blocks.{layer}.attn.{name}_proj.{kind}"
    _our_qkv = re.compile(r"^visual\.blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
    _hf_qkv_key = "visual.blocks.{layer}.attn.qkv.{kind}"
    _qkv_owner = "visual.blocks.{layer}.attn"
    _PATCH_EMBED = "visual.patch_embed.proj.weight"

    def _patch_embed_in(self, k: str, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1) if k == self._PATCH_EMBED and t.dim() == 5 else t

    def _patch_embed_out(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if key != self._PATCH_EMBED:
            return t
        v = self.args.vision
        return t.reshape(t.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
