"""Qwen3-VL / Qwen3-VL-MoE weights: Hugging Face checkpoint keys <-> this package's module names.

HF layouts read:
* the hub / `save_pretrained` layout: `model.visual.*`, `model.language_model.*`, `lm_head.weight`;
* the same without the `model.` prefix (`visual.*`, `language_model.*`), as found in raw state dicts.
Export writes the hub layout, which transformers, vLLM and SGLang read.

Conversions (the only place fused or reshaped weights are handled):
* vision `attn.qkv` [3E, E] (+ bias) <-> `attn.q_proj` / `k_proj` / `v_proj` (rows q, then k, then v);
* vision `attn.proj` <-> `attn.o_proj`; `linear_fc1` / `linear_fc2` <-> `fc1` / `fc2` (blocks' MLP, the
  merger, the DeepStack mergers);
* `patch_embed.proj.weight`: Conv3d [E, C, T, P, P] <-> Linear [E, C*T*P*P] (same element order);
* MoE experts: ours (= transformers >= 5 in memory) `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I].
  The hub stores them transposed ([E, H, 2I], [E, I, H]); both are read, telling them apart by
  shape. When the shapes cannot tell (H == 2I, resp. H == I) the tensor is taken as stored, which is
  also what transformers does, and export writes it untransposed so transformers reads it back right.
With tied embeddings `lm_head.weight` is not a separate tensor: ignored on load, omitted on export.

`from_hf` works on any subset of the checkpoint (one shard or one tensor at a time): every HF
tensor maps to our tensors on its own, so nothing is left pending between shards.
"""
from __future__ import annotations

import re

import torch

from megatron_vlm.models.common.state_dict_utils import join_fused_qkv, rename_all, split_fused_qkv
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs

_VIS_QKV = re.compile(r"^visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_OUR_VIS_QKV = re.compile(r"^visual\.blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
_EXPERTS = re.compile(r"^language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")

# (ours, HF) module-name pieces inside `visual.`
_RENAMES = [
    (r"^visual\.blocks\.(\d+)\.attn\.o_proj\.", r"visual.blocks.\1.attn.proj."),
    (r"^visual\.blocks\.(\d+)\.mlp\.fc([12])\.", r"visual.blocks.\1.mlp.linear_fc\2."),
    (r"^visual\.merger\.fc([12])\.", r"visual.merger.linear_fc\1."),
    (r"^visual\.deepstack_merger_list\.(\d+)\.fc([12])\.", r"visual.deepstack_merger_list.\1.linear_fc\2."),
]
_RENAMES_BACK = [
    (r"^visual\.blocks\.(\d+)\.attn\.proj\.", r"visual.blocks.\1.attn.o_proj."),
    (r"^visual\.blocks\.(\d+)\.mlp\.linear_fc([12])\.", r"visual.blocks.\1.mlp.fc\2."),
    (r"^visual\.merger\.linear_fc([12])\.", r"visual.merger.fc\1."),
    (r"^visual\.deepstack_merger_list\.(\d+)\.linear_fc([12])\.", r"visual.deepstack_merger_list.\1.fc\2."),
]


class Qwen3VLStateDictAdapter:
    def __init__(self, args: Qwen3VLArgs) -> None:
        self.args = args

    # ----- HF -> ours -----
    @staticmethod
    def normalize_hf_key(key: str) -> str:
        """Any known HF layout -> our prefix convention (`visual.*`, `language_model.*`, `lm_head.weight`)."""
        if key.startswith("model.visual.") or key.startswith("model.language_model."):
            return key[len("model."):]
        return key

    def is_ignored(self, key: str) -> bool:
        k = self.normalize_hf_key(key)
        return k.endswith("rotary_emb.inv_freq") or (self.args.tie_word_embeddings and k == "lm_head.weight")

    def _expert_shapes(self, kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(ours, hub) trailing shapes of one expert tensor."""
        t = self.args.text
        ours = (2 * t.moe_intermediate_size, t.hidden_size) if kind == "gate_up_proj" else (t.hidden_size, t.moe_intermediate_size)
        return ours, (ours[1], ours[0])

    def _expert_from_hf(self, key: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        ours, hub = self._expert_shapes(kind)
        if t.dim() != 3 or tuple(t.shape[1:]) not in (ours, hub):
            raise ValueError(
                f"{key}: shape {tuple(t.shape)} fits neither [E, {ours[0]}, {ours[1]}] nor the hub's [E, {hub[0]}, {hub[1]}]"
            )
        if tuple(t.shape[1:]) == ours:  # also the ambiguous square case, as transformers reads it
            return t
        return t.transpose(1, 2)

    def from_hf(self, hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Map HF tensors to ours; returns (converted, pending) - pending is always empty for this family."""
        out: dict[str, torch.Tensor] = {}
        for key, t in hf.items():
            if self.is_ignored(key):
                continue
            k = self.normalize_hf_key(key)
            m = _VIS_QKV.match(k)
            if m:
                layer, kind = m.groups()
                for name, part in split_fused_qkv(key, t).items():
                    out[f"visual.blocks.{layer}.attn.{name}_proj.{kind}"] = part
                continue
            m = _EXPERTS.match(k)
            if m:
                out[k] = self._expert_from_hf(key, m.group(2), t)
                continue
            if k == "visual.patch_embed.proj.weight" and t.dim() == 5:
                t = t.reshape(t.shape[0], -1)
            out[rename_all(k, _RENAMES_BACK)] = t
        return out, {}

    # ----- ours -> HF -----
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF tensors in the hub layout (fused vision qkv, Conv3d patch embed,
        experts transposed)."""
        v = self.args.vision
        out: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for key, t in state_dict.items():
            m = _OUR_VIS_QKV.match(key)
            if m:
                layer, name, kind = m.groups()
                qkv.setdefault((layer, kind), {})[name] = t
                continue
            if key == "lm_head.weight":
                if not self.args.tie_word_embeddings:
                    out[key] = t
                continue
            m = _EXPERTS.match(key)
            if m:
                ours, hub = self._expert_shapes(m.group(2))
                out["model." + key] = t if ours == hub else t.transpose(1, 2).contiguous()
                continue
            k = key
            if k == "visual.patch_embed.proj.weight":
                t = t.reshape(t.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
            out["model." + rename_all(k, _RENAMES)] = t
        for layer, kind, fused in join_fused_qkv(qkv, "visual.blocks.{layer}.attn"):
            out[f"model.visual.blocks.{layer}.attn.qkv.{kind}"] = fused
        return out
