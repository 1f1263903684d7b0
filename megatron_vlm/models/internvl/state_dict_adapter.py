"""InternVL weights: Hugging Face checkpoint keys <-> this package's module names.

Layouts read (any mix, one tensor at a time):
* transformers' checkpoint layout (what `save_pretrained` writes and the `-hf` repos hold):
  `vision_tower.embeddings.*`, `vision_tower.encoder.layer.N.{attention.*, lambda_1/2,
  layernorm_before/after, mlp.*}`, `multi_modal_projector.{layer_norm, linear_1, linear_2}`,
  `language_model.model.*`, `language_model.lm_head.weight`;
* transformers' module names (raw `state_dict()`): the same under `model.` with
  `model.language_model.*` for the decoder and a top-level `lm_head.weight`;
* OpenGVLab's remote-code layout (the original repos): `vision_model.embeddings.{class_embedding,
  position_embedding, patch_embedding}`, `vision_model.encoder.layers.N.{attn.qkv (fused q/k/v rows),
  attn.proj, attn.q_norm, attn.k_norm, ls1, ls2, norm1, norm2, mlp.fc1, mlp.fc2}`, `mlp1.{0, 1, 3}`
  (LayerNorm, Linear, -, Linear), `language_model.model.*`, `language_model.lm_head.weight`.
Export writes transformers' checkpoint layout (loadable by `AutoModelForImageTextToText`, vLLM).

Our names follow the original vision naming (`vision_tower.layers.N.{attn.{q,k,v,o}_proj, ls1, norm1,
...}`, `vision_tower.embeddings.{cls_token, patch_embedding, position_embedding}`), transformers'
projector names, and `language_model.{embed_tokens, layers, norm}` + `lm_head`. With tied
embeddings the LM head is not a separate tensor: ignored on load, omitted on export.
"""
from __future__ import annotations

import re

import torch

from megatron_vlm.models.common.state_dict_utils import StateDictAdapter, rename_first
from megatron_vlm.models.internvl.args import InternVLArgs

_ORIG_QKV = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.attn\.qkv\.(weight|bias)$")

# (transformers' checkpoint name, ours), one line per renamed piece: `{i}` is a layer index; a name ending in "."
# renames every key under it, any other names one key. Both directions are generated from this one list.
_HF_NAMES = [
    ("vision_tower.embeddings.position_embeddings", "vision_tower.embeddings.position_embedding"),
    ("vision_tower.embeddings.patch_embeddings.projection.", "vision_tower.embeddings.patch_embedding."),
    ("vision_tower.embeddings.cls_token", "vision_tower.embeddings.cls_token"),
    ("vision_tower.embeddings.mask_token", "vision_tower.embeddings.mask_token"),
    ("vision_tower.encoder.layer.{i}.attention.projection_layer.", "vision_tower.layers.{i}.attn.o_proj."),
    ("vision_tower.encoder.layer.{i}.attention.", "vision_tower.layers.{i}.attn."),
    ("vision_tower.encoder.layer.{i}.lambda_1", "vision_tower.layers.{i}.ls1"),
    ("vision_tower.encoder.layer.{i}.lambda_2", "vision_tower.layers.{i}.ls2"),
    ("vision_tower.encoder.layer.{i}.layernorm_before.", "vision_tower.layers.{i}.norm1."),
    ("vision_tower.encoder.layer.{i}.layernorm_after.", "vision_tower.layers.{i}.norm2."),
    ("vision_tower.encoder.layer.{i}.mlp.", "vision_tower.layers.{i}.mlp."),
    ("vision_tower.layernorm.", "vision_tower.layernorm."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.weight", "lm_head.weight"),
]


def _rename_table(names: list[tuple[str, str]], *, to_ours: bool) -> list[tuple[str, str]]:
    """`names` as (regex, replacement) pairs in one direction, in list order (first match wins)."""
    table = []
    for hf, ours in names:
        src, dst = (hf, ours) if to_ours else (ours, hf)
        pattern = "^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)") + ("" if src.endswith(".") else "$")
        table.append((pattern, dst.replace("{i}", r"\1")))
    return table


# key -> ours, applied to the normalised key (first match wins): transformers' layout, then OpenGVLab's
_TO_OURS = _rename_table(_HF_NAMES, to_ours=True) + [
    # OpenGVLab vision layout (qkv handled separately)
    (r"^vision_model\.embeddings\.class_embedding$", "vision_tower.embeddings.cls_token"),
    (r"^vision_model\.embeddings\.position_embedding$", "vision_tower.embeddings.position_embedding"),
    (r"^vision_model\.embeddings\.patch_embedding\.", "vision_tower.embeddings.patch_embedding."),
    (r"^vision_model\.encoder\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.layers.\1.attn.o_proj."),
    (r"^vision_model\.encoder\.layers\.(\d+)\.", r"vision_tower.layers.\1."),
    # OpenGVLab projector
    (r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
    (r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
    (r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
]
# ours -> transformers' checkpoint layout
_TO_HF = _rename_table(_HF_NAMES, to_ours=False)


class InternVLStateDictAdapter(StateDictAdapter):
    args: InternVLArgs
    _hf_qkv = _ORIG_QKV  # OpenGVLab's fused InternViT qkv; exported as transformers' separate q / k / v
    _ours_qkv = "vision_tower.layers.{layer}.attn.{name}_proj.{kind}"
    _lm_head = "language_model.lm_head.weight"

    @staticmethod
    def normalize_hf_key(key: str) -> str:
        """transformers' module names -> its checkpoint layout (OpenGVLab keys pass through unchanged)."""
        if key.startswith("model.language_model."):
            return "language_model.model." + key[len("model.language_model."):]
        if key.startswith("model.vision_tower.") or key.startswith("model.multi_modal_projector."):
            return key[len("model."):]
        if key == "lm_head.weight":
            return "language_model.lm_head.weight"
        return key

    def _qkv_rows(self) -> int:
        return self.args.vision.hidden_size

    # ----- HF / OpenGVLab -> ours -----
    def _from_hf_one(self, key: str, k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        new = rename_first(k, _TO_OURS)
        if new is None:
            raise ValueError(f"{key}: not a key of a transformers or OpenGVLab InternVL checkpoint")
        return {new: t}

    # ----- ours -> HF (transformers' checkpoint layout) -----
    def _to_hf_one(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        new = rename_first(key, _TO_HF)
        if new is None:
            raise ValueError(f"{key}: no transformers InternVL name for this parameter")
        return {new: t}
