"""Text-only Qwen weights (qwen2 / qwen3 / qwen3_moe): Hugging Face checkpoint keys <-> our module names.

HF (`Qwen2ForCausalLM` etc.): `model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head.weight`;
ours: `language_model.*` (the shared decoder's names equal transformers' inside a layer) and
`lm_head.weight`. With tied embeddings `lm_head.weight` is ignored on load and omitted on export.

Qwen3-MoE experts: ours (= transformers >= 5 in memory) are fused per layer, `experts.gate_up_proj`
[E, 2I, H] (gate rows then up rows) and `experts.down_proj` [E, H, I]. The hub (and transformers'
`save_pretrained`, and vLLM's loader) use one Linear per expert,
`model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight`. Both are read; per-expert tensors wait in
`pending` until the layer's 3 x E tensors have all been seen (a layer may span shards), then are
stacked. Export writes the per-expert hub layout.
"""
from __future__ import annotations

import re

import torch

from megatron_vlm.models.qwen_text.args import QwenTextArgs

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_OUR_EXPERTS = re.compile(r"^language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class QwenTextStateDictAdapter:
    def __init__(self, args: QwenTextArgs) -> None:
        self.args = args

    @staticmethod
    def normalize_hf_key(key: str) -> str:
        """`model.X` -> `language_model.X`; `lm_head.weight` as is (also accepts our own names)."""
        return "language_model." + key[len("model."):] if key.startswith("model.") else key

    def is_ignored(self, key: str) -> bool:
        return key.endswith("rotary_emb.inv_freq") or (self.args.tie_word_embeddings and key == "lm_head.weight")

    # ----- HF -> ours -----
    def from_hf(self, hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Map HF tensors to ours; returns (converted, pending): per-expert tensors of a layer not yet complete."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in hf.items():
            if self.is_ignored(key):
                continue
            m = _PER_EXPERT.match(key)
            if m:
                experts.setdefault(int(m.group(1)), {})[key] = t
                continue
            out[self.normalize_hf_key(key)] = t
        pending: dict[str, torch.Tensor] = {}
        n = getattr(self.args.text, "num_experts", 0)
        for layer, group in experts.items():
            if not n:
                raise ValueError(f"{next(iter(group))}: expert weights in a {self.args.model_type} checkpoint (no experts)")
            if len(group) < 3 * n:
                pending.update(group)
                continue
            prefix = f"model.layers.{layer}.mlp.experts"
            try:
                gate_up = [torch.cat([group[f"{prefix}.{e}.gate_proj.weight"], group[f"{prefix}.{e}.up_proj.weight"]])
                           for e in range(n)]
                down = [group[f"{prefix}.{e}.down_proj.weight"] for e in range(n)]
            except KeyError as e:
                raise ValueError(f"{prefix}: expert tensor {e} missing ({len(group)} given for {n} experts)") from None
            out[f"language_model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
            out[f"language_model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
        return out, pending

    # ----- ours -> HF -----
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF tensors in the hub layout (per-expert Linear weights)."""
        out: dict[str, torch.Tensor] = {}
        for key, t in state_dict.items():
            if key == "lm_head.weight":
                if not self.args.tie_word_embeddings:
                    out[key] = t
                continue
            if not key.startswith("language_model."):
                raise ValueError(f"{key}: not a parameter of a text-only Qwen model")
            m = _OUR_EXPERTS.match(key)
            if m:
                layer, kind = m.groups()
                prefix = f"model.layers.{layer}.mlp.experts"
                for e in range(t.shape[0]):
                    if kind == "gate_up_proj":
                        gate, up = t[e].chunk(2, dim=0)
                        out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                        out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                    else:
                        out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
                continue
            out["model." + key[len("language_model."):]] = t
        return out
