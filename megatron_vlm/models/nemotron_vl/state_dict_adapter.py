"""Nemotron-H / Nemotron-3-Nano-VL weights: Hugging Face checkpoint keys <-> this package's names.

HF layouts read (both model types):
* checkpoint layout (NVIDIA releases, and what transformers 5's `save_pretrained` writes):
  `backbone.*` + `lm_head.weight` (nemotron_h); `language_model.backbone.*`,
  `language_model.lm_head.weight`, `mlp1.{0,1,3}.*` (projector) and
  `vision_model.radio_model.model.{patch_generator,blocks}.*` (nemotron_h_omni); MoE experts one
  tensor per expert (`mixer.experts.{e}.up_proj.weight` `[F, H]`);
* transformers 5's in-memory names: `model.*` / `language_model.model.*`, `multi_modal_projector.*`,
  `vision_model.embeddings.*` / `vision_model.encoder.layer.*`, experts stacked (`mixer.experts.up_proj`
  `[E, F, H]`).
Export writes the checkpoint layout.

Conversions (the only place weights are fused / split / stacked):
* per-expert `experts.{e}.{up,down}_proj.weight` <-> stacked `experts.{up,down}_proj` `[E, out, in]`
  (the per-expert tensors of a layer are held back as `pending` until all E have been read);
* RADIO `attn.qkv` `[3E, E]` (+ bias) <-> `attention.{q,k,v}_proj`; `attn.proj` <-> `attention.o_proj`;
  patch generator `embedder` / `video_embedder` / `pos_embed` / `cls_token.token` <->
  `embeddings.patch_projection` / `video_patch_projection` / `position_embedding` / `cls_register_token`.
Qwen3-VL vision variant (`vision_config.model_type` "qwen3_vl"): the language model keeps the
nemotron_h_omni layout above (`language_model.backbone.*`, `language_model.lm_head.weight`); the
vision tower is written as `vision_model.` + the names transformers' `Qwen3VLVisionModel` uses
(`patch_embed.proj` Conv3d, `pos_embed`, `blocks.{i}.attn.qkv` / `attn.proj` / `mlp.linear_fc{1,2}`,
`merger.{norm,linear_fc1,linear_fc2}`, `deepstack_merger_list.{j}.*`), converted by the Qwen3-VL
family's own adapter (not repeated here). Why this naming: NVIDIA's public Nemotron-3-Nano-VL code
in cosmos-rl (its `dev/nemotron` branch: `parallelize.py` and weight-check scripts
for `NVIDIA-Nemotron-3-Nano-VL-30B-A3B`) reads the checkpoint straight into a remote-code model
whose top-level modules are `vision_model` (a Qwen3-VL vision tower - `train_layers =
["Qwen3VLVisionPatchMerger"]` selects its mergers by class name) and `language_model`, with
`config.text_config.layers_block_type`; checkpoint keys are those module paths. The released
checkpoint itself is not public, so the exact key list could not be checked; Qwen3-VL's own
`model.visual.*` (and `visual.*`) are therefore read as aliases of `vision_model.*`.
Ignored on load: multi-token-prediction heads (`mtp.*`), RADIO's `summary_idxs` and
`input_conditioner` buffers (normalisation happens in the processor), tied `lm_head.weight`.
"""
from __future__ import annotations

import re

import torch

from megatron_vlm.models.common.state_dict_utils import join_fused_qkv, split_fused_qkv
from megatron_vlm.models.nemotron_vl.args import NemotronVLArgs
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs, Qwen3VLTextArgs
from megatron_vlm.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter

_EXPERT = re.compile(r"^(language_model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_OUR_EXPERT = re.compile(r"^(language_model\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)$")
_QKV = re.compile(r"^vision_model\.encoder\.layer\.(\d+)\.attn\.qkv\.(weight|bias)$")
_OUR_QKV = re.compile(r"^vision_model\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")

_RADIO = "vision_model.radio_model.model."
# RADIO checkpoint prefix <-> our prefix
_VISION_PREFIXES = [
    (_RADIO + "patch_generator.embedder.", "vision_model.embeddings.patch_projection."),
    (_RADIO + "patch_generator.video_embedder.", "vision_model.embeddings.video_patch_projection."),
    (_RADIO + "patch_generator.pos_embed", "vision_model.embeddings.position_embedding"),
    (_RADIO + "patch_generator.cls_token.token", "vision_model.embeddings.cls_register_token"),
    (_RADIO + "blocks.", "vision_model.encoder.layer."),
]
# checkpoint prefix -> our prefix (applied in order; the first match wins)
_PREFIXES_IN = [
    ("language_model.backbone.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("backbone.", "language_model."),
    ("model.", "language_model."),
    ("mlp1.0.", "multi_modal_projector.layer_norm."),
    ("mlp1.1.", "multi_modal_projector.linear_1."),
    ("mlp1.3.", "multi_modal_projector.linear_2."),
    # the vision tower's final LayerNorm of checkpoints whose language model has MTP layers: the original
    # checkpoint's name (transformers >= 5.24 also saves it so); `vision_final_layernorm.` is ours already
    ("vision_projector.vision_final_layernorm.", "vision_final_layernorm."),
    *_VISION_PREFIXES,
]
_IGNORED = re.compile(
    r"^(mtp\.|language_model\.mtp\.|vision_model\.(radio_model\.)?summary_idxs$|vision_model\.(radio_model\.)?input_conditioner\.)"
    r"|rotary_emb\.inv_freq$|rotary_pos_emb\.inv_freq$"
)
# Qwen3-VL vision keys of a checkpoint (ours first, then Qwen3-VL's own layouts)
_QWEN3_VISION_IN = ("vision_model.", "model.visual.", "visual.")


class NemotronVLStateDictAdapter:
    def __init__(self, args: NemotronVLArgs) -> None:
        self.args = args
        self.omni = args.vision is not None
        self.qwen3_vision = None
        if args.vision_tower == "qwen3_vl":
            # the Qwen3-VL adapter converts the vision keys; it reads only `vision` (and the tie flag)
            self.qwen3_vision = Qwen3VLStateDictAdapter(
                Qwen3VLArgs(vision=args.vision, text=Qwen3VLTextArgs(hidden_size=args.text.hidden_size),
                            tie_word_embeddings=False)
            )

    def _qwen3_vision_key(self, key: str) -> str | None:
        """A checkpoint key of the Qwen3-VL tower in Qwen3-VL's hub spelling (`model.visual.*`), else None."""
        if self.qwen3_vision is None:
            return None
        for prefix in _QWEN3_VISION_IN:
            if key.startswith(prefix):
                return "model.visual." + key[len(prefix):]
        return None

    # ----- HF -> ours -----
    def normalize_hf_key(self, key: str) -> str:
        """Any known HF layout -> our module path (fused qkv / per-expert keys are left for from_hf)."""
        for src, dst in _PREFIXES_IN:
            if key.startswith(src) and (self.omni or not src.startswith(("language_model.", "mlp1", "vision"))):
                key = dst + key[len(src):]
                break
        return re.sub(r"^(vision_model\.encoder\.layer\.\d+)\.attn\.proj\.", r"\1.attention.o_proj.", key)

    def is_ignored(self, key: str) -> bool:
        if _IGNORED.search(key):
            return True
        return self.args.tie_word_embeddings and self.normalize_hf_key(key) == "lm_head.weight"

    def from_hf(self, hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Map HF tensors to ours; per-expert tensors wait in `pending` until their layer is complete."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, tuple[str, torch.Tensor]]] = {}
        vision: dict[str, torch.Tensor] = {}
        for key, t in hf.items():
            if self.is_ignored(key):
                continue
            qkey = self._qwen3_vision_key(key)
            if qkey is not None:
                if qkey in vision:
                    raise ValueError(f"{key}: the vision tensor {qkey} appears twice (in two key layouts)")
                vision[qkey] = t
                continue
            k = self.normalize_hf_key(key)
            m = _EXPERT.match(k)
            if m:
                prefix, e, proj = m.groups()
                experts.setdefault((prefix, proj), {})[int(e)] = (key, t)
                continue
            m = _QKV.match(k)
            if m:
                layer, kind = m.groups()
                for name, part in split_fused_qkv(key, t).items():
                    out[f"vision_model.encoder.layer.{layer}.attention.{name}_proj.{kind}"] = part
                continue
            out[k] = t
        if vision:
            converted, _ = self.qwen3_vision.from_hf(vision)
            out.update({"vision_model." + k[len("visual."):]: v for k, v in converted.items()})
        pending: dict[str, torch.Tensor] = {}
        num_experts = self.args.text.n_routed_experts
        for (prefix, proj), parts in experts.items():
            if len(parts) == num_experts:
                if sorted(parts) != list(range(num_experts)):
                    raise ValueError(f"{prefix}: expert indices {sorted(parts)} are not 0..{num_experts - 1}")
                out[f"{prefix}.{proj}"] = torch.stack([parts[e][1] for e in range(num_experts)])
            elif len(parts) > num_experts:
                raise ValueError(f"{prefix}.{proj}: {len(parts)} experts in the checkpoint, config says {num_experts}")
            else:
                pending.update({hf_key: t for hf_key, t in parts.values()})
        return out, pending

    @staticmethod
    def default_for(key: str, shape) -> torch.Tensor | None:
        """Value of a parameter a checkpoint may legitimately omit, else None. C-RADIO has no layer
        scale: released checkpoints carry no `layer_scale{1,2}.lambda1`, which transformers then keeps
        at its identity value 1 (the loader calls this for parameters still missing at the end)."""
        if re.fullmatch(r"vision_model\.encoder\.layer\.\d+\.layer_scale[12]\.lambda1", key):
            return torch.ones(shape)
        return None

    # ----- ours -> HF -----
    def _checkpoint_key(self, key: str) -> str:
        if key.startswith("language_model."):
            rest = key[len("language_model."):]
            return ("language_model.backbone." if self.omni else "backbone.") + rest
        if key.startswith("lm_head."):
            return ("language_model." if self.omni else "") + key
        for ours, hf in (("multi_modal_projector.layer_norm.", "mlp1.0."), ("multi_modal_projector.linear_1.", "mlp1.1."),
                         ("multi_modal_projector.linear_2.", "mlp1.3.")):
            if key.startswith(ours):
                return hf + key[len(ours):]
        for hf, ours in _VISION_PREFIXES:
            if key.startswith(ours):
                key = hf + key[len(ours):]
                break
        return re.sub(r"\.attention\.o_proj\.", ".attn.proj.", key)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict -> HF tensors in the checkpoint layout."""
        out: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        if self.qwen3_vision is not None:
            vision = {"visual." + k[len("vision_model."):]: t for k, t in state_dict.items() if k.startswith("vision_model.")}
            for k, t in self.qwen3_vision.to_hf(vision).items():
                out["vision_model." + k[len("model.visual."):]] = t
            state_dict = {k: t for k, t in state_dict.items() if not k.startswith("vision_model.")}
        for key, t in state_dict.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            m = _OUR_EXPERT.match(key)
            if m:
                prefix, proj = m.groups()
                for e in range(t.shape[0]):
                    out[self._checkpoint_key(f"{prefix}.{e}.{proj}.weight")] = t[e]
                continue
            m = _OUR_QKV.match(key)
            if m:
                layer, name, kind = m.groups()
                qkv.setdefault((layer, kind), {})[name] = t
                continue
            out[self._checkpoint_key(key)] = t
        for layer, kind, fused in join_fused_qkv(qkv, "vision layer {layer}"):
            out[f"{_RADIO}blocks.{layer}.attn.qkv.{kind}"] = fused
        if self.args.vision_tower == "radio":
            out["vision_model.radio_model.summary_idxs"] = torch.tensor(self.args.vision.summary_idxs, dtype=torch.long)
        return out
