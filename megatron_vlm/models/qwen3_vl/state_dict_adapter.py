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

from megatron_vlm.models.common.state_dict_utils import QwenVisionAdapter, rename_all
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs

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


class Qwen3VLStateDictAdapter(QwenVisionAdapter):
    args: Qwen3VLArgs
    _hf_qkv_key = "model." + QwenVisionAdapter._hf_qkv_key  # the hub layout

    # ----- HF -> ours -----
    @staticmethod
    def normalize_hf_key(key: str) -> str:
        """Any known HF layout -> our prefix convention (`visual.*`, `language_model.*`, `lm_head.weight`)."""
        if key.startswith("model.visual.") or key.startswith("model.language_model."):
            return key[len("model."):]
        return key

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

    def _from_hf_one(self, key: str, k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        m = _EXPERTS.match(k)
        if m:
            return {k: self._expert_from_hf(key, m.group(2), t)}
        return {rename_all(k, _RENAMES_BACK): self._patch_embed_in(k, t)}

    # ----- ours -> HF (the hub layout: fused vision qkv, Conv3d patch embed, experts transposed) -----
    def _to_hf_one(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if key == "lm_head.weight":
            return {key: t}
        m = _EXPERTS.match(key)
        if m:
            ours, hub = self._expert_shapes(m.group(2))
            return {"model." + key: t if ours == hub else t.transpose(1, 2).contiguous()}
        return {"model." + rename_all(key, _RENAMES): self._patch_embed_out(key, t)}
