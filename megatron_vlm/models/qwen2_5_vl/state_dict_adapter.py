"""Qwen2.5-VL weights: Hugging Face checkpoint keys <-> this package's module names.

HF layouts read:
* the checkpoint layout (the original Qwen release, and what transformers 5's `save_pretrained`
  still writes): `visual.*`, `model.*` (the decoder), `lm_head.weight`;
* transformers 5's in-memory module names: `model.visual.*`, `model.language_model.*`, `lm_head.weight`
  (found in checkpoints saved from a raw `state_dict()`).
Export writes the checkpoint layout, which transformers (4.x and 5), vLLM and VLMEvalKit all read.

Conversions (the only place fused weights are split or joined):
* vision `attn.qkv` [3E, E] (+ bias) <-> `attn.q_proj` / `k_proj` / `v_proj` (rows q, then k, then v);
* vision `attn.proj` <-> `attn.o_proj`; merger `mlp.0` / `mlp.2` <-> `fc1` / `fc2`;
* `patch_embed.proj.weight`: Conv3d [E, C, T, P, P] <-> Linear [E, C*T*P*P] (same element order).
With tied embeddings `lm_head.weight` is not a separate tensor: ignored on load, omitted on export.

`from_hf` works on any subset of the checkpoint (one shard or one tensor at a time): every HF
tensor maps to our tensors on its own, so nothing is left pending between shards.
"""
from __future__ import annotations

import torch

from megatron_vlm.models.common.state_dict_utils import QwenVisionAdapter, rename_all
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLArgs

# our name <-> HF name (after the "model." prefix) for the renamed modules, as regex pairs
_RENAMES = [
    (r"^visual\.blocks\.(\d+)\.attn\.o_proj\.", r"visual.blocks.\1.attn.proj."),
    (r"^visual\.merger\.fc1\.", "visual.merger.mlp.0."),
    (r"^visual\.merger\.fc2\.", "visual.merger.mlp.2."),
]
_RENAMES_BACK = [
    (r"^visual\.blocks\.(\d+)\.attn\.proj\.", r"visual.blocks.\1.attn.o_proj."),
    (r"^visual\.merger\.mlp\.0\.", "visual.merger.fc1."),
    (r"^visual\.merger\.mlp\.2\.", "visual.merger.fc2."),
]


class Qwen2_5_VLStateDictAdapter(QwenVisionAdapter):
    args: Qwen2_5_VLArgs

    # ----- HF -> ours -----
    @staticmethod
    def normalize_hf_key(key: str) -> str:
        """Any known HF layout -> the transformers >= 5 key without its leading 'model.' (lm_head kept)."""
        if key.startswith("model.visual.") or key.startswith("model.language_model."):
            return key[len("model."):]
        if key.startswith("visual."):
            return key
        if key.startswith("model."):  # 4.x decoder
            return "language_model." + key[len("model."):]
        return key

    def _from_hf_one(self, key: str, k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {rename_all(k, _RENAMES_BACK): self._patch_embed_in(k, t)}

    # ----- ours -> HF (the checkpoint layout: fused vision qkv, Conv3d patch embed) -----
    @staticmethod
    def _checkpoint_key(key: str) -> str:
        """Our module path (renames applied) -> the checkpoint layout key."""
        if key.startswith("language_model."):
            return "model." + key[len("language_model."):]
        return key  # visual.*, lm_head.weight

    def _to_hf_one(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self._checkpoint_key(rename_all(key, _RENAMES)): self._patch_embed_out(key, t)}
