"""LoRA adapters in PEFT's folder format: `adapter_config.json` + `adapter_model.safetensors`.

What `peft` 0.21 writes (and `PeftModel.from_pretrained(transformers_model, folder)` reads): tensors
named `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, where `<module>` is the module's
name inside the transformers model *in memory* (transformers 5: `model.language_model.layers.0.
self_attn.q_proj` for Qwen2.5-VL and InternVL; the checkpoint files use other prefixes), and a
config with `peft_type = "LORA"`, `r`, `lora_alpha`, `lora_dropout`, `use_rslora`, `target_modules`.
We write `target_modules` as the explicit list of adapted module names: PEFT matches a short name
such as "q_proj" as a suffix anywhere, which would also adapt the vision tower's layers of that name.

Our module name -> PEFT name goes through the family's state-dict adapter (`to_hf` of the layer's
weight, which must map to exactly one HF tensor of the same shape and back: a layer fused with
others in the HF checkpoint, e.g. Qwen2.5-VL's vision q/k/v -> `qkv`, has no PEFT name and cannot be
adapted), then from the checkpoint layout to the in-memory layout (`_IN_MEMORY_RENAMES`, per
model_type; identity when the two agree). Reading goes back through the adapter's `from_hf`, which
accepts every layout it loads weights from — so adapters trained with PEFT on the transformers
model load too.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_vlm.checkpoint.hf import export_folder, replace_dir, share_like_umask
from megatron_vlm.finite import check_finite
from megatron_vlm.models.common.state_dict_utils import rename_first
from megatron_vlm.models.registry import get_family

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PeftNames", "save_peft_adapter", "read_peft_adapter",
           "is_peft_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_MARKER = ".adapter_complete"
_PREFIX = "base_model.model."

# checkpoint-layout module name -> transformers' in-memory module name (first match wins; none: unchanged)
_IN_MEMORY_RENAMES = {
    "qwen2_5_vl": [
        (r"^model\.(language_model|visual)\.", r"model.\1."),
        (r"^model\.", "model.language_model."),
        (r"^visual\.", "model.visual."),
    ],
    "internvl": [
        (r"^language_model\.model\.", "model.language_model."),
        (r"^language_model\.lm_head$", "lm_head"),
        (r"^(vision_tower|multi_modal_projector)\.", r"model.\1."),
    ],
    "nemotron_h_omni": [(r"^language_model\.backbone\.", "language_model.model.")],
}
# model types whose export layout is not the layout of the model PEFT would wrap outside the decoder
# (OpenGVLab's remote-code InternVL: fused vision qkv, `mlp1`): only `language_model.*` layers have names
# Nemotron-VL: the RADIO tower's checkpoint names are not transformers' module names (no rename checked yet)
_DECODER_ONLY = {"internvl_chat", "nemotron_h_omni"}


class PeftNames:
    """Our module names <-> PEFT module names for one model (built from its config.json dict)."""

    def __init__(self, hf_config: dict) -> None:
        self.model_type = hf_config.get("model_type")
        family = get_family(self.model_type)
        self.adapter = family.state_dict_adapter(family.args_cls.from_hf_config(hf_config))
        # tensors the export adds whatever it is given (Nemotron-VL's RADIO `summary_idxs` constant): not
        # part of any one layer's name, so left out when a single weight is mapped (else no layer had a name)
        self._constant = frozenset(self.adapter.to_hf({}))

    def to_peft(self, module: str, shape: tuple[int, int]) -> Optional[str]:
        """PEFT name of our Linear `module` with weight `shape`, or None when it has no 1:1 HF twin."""
        if self.model_type in _DECODER_ONLY and not module.startswith("language_model."):
            return None
        w = torch.empty(shape, device="meta")
        try:
            hf = {k: v for k, v in self.adapter.to_hf({f"{module}.weight": w}).items() if k not in self._constant}
            if len(hf) != 1:
                return None
            (key, t), = hf.items()
            if not key.endswith(".weight") or tuple(t.shape) != tuple(shape):
                return None
            back, pending = self.adapter.from_hf({key: w})
        except (ValueError, KeyError, RuntimeError):
            return None
        if pending or list(back) != [f"{module}.weight"]:
            return None
        name = key[: -len(".weight")]
        return rename_first(name, _IN_MEMORY_RENAMES.get(self.model_type, [])) or name

    def to_ours(self, peft_module: str, shape: tuple[int, int]) -> Optional[str]:
        """Our module name for a PEFT module name (any layout the family's adapter reads), or None."""
        w = torch.empty(shape, device="meta")
        try:
            back, pending = self.adapter.from_hf({f"{peft_module}.weight": w})
        except (ValueError, KeyError, RuntimeError):
            return None
        if pending or len(back) != 1:
            return None
        key = next(iter(back))
        return key[: -len(".weight")] if key.endswith(".weight") else None


def _named(factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """module -> (A, B) as "<module>.lora_A" / "<module>.lora_B" -> tensor (for messages naming the factor)."""
    return {f"{m}.{part}": t for m, ab in factors.items() for part, t in zip(("lora_A", "lora_B"), ab)}


def is_peft_adapter(path: Union[str, Path]) -> bool:
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def save_peft_adapter(
    path: Union[str, Path],
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    hf_config: dict,
    *,
    r: int,
    alpha: float,
    dropout: float,
    use_rslora: bool,
    base_model_name_or_path: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write `factors` (our module name -> (lora_A [r, in], lora_B [out, r]), unsharded) as a PEFT folder.

    The folder is written to a temporary sibling and put in place when complete (a crash leaves the
    previous adapter intact). Raises ValueError naming a module that has no PEFT name."""
    path = export_folder(path)
    check_finite(_named(factors), f"refusing to write the LoRA adapter {path}")
    names = PeftNames(hf_config)
    tensors: dict[str, torch.Tensor] = {}
    targets = []
    for module, (a, b) in sorted(factors.items()):
        peft = names.to_peft(module, (b.shape[0], a.shape[1]))
        if peft is None:
            raise ValueError(f"LoRA on {module}: this layer has no single Hugging Face counterpart "
                             "(fused or reshaped in the checkpoint); it cannot be written in PEFT format")
        targets.append(peft)
        for part, t in (("lora_A", a), ("lora_B", b)):
            t = t.detach().to("cpu").contiguous()
            tensors[f"{_PREFIX}{peft}.{part}.weight"] = t.to(dtype) if dtype is not None else t
    config = {
        "peft_type": "LORA",
        **_auto_class_fields(hf_config),
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(r),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "use_rslora": bool(use_rslora),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        share_like_umask(tmp)
        replace_dir(tmp, path, old, marker=ADAPTER_MARKER, marker_text="peft adapter complete\n", is_complete=Path.is_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _auto_class_fields(hf_config: dict) -> dict:
    """What `AutoPeftModel*.from_pretrained(adapter)` reads to build the base model: a causal LM's `task_type`
    ("CAUSAL_LM", for `AutoPeftModelForCausalLM`); otherwise, as peft writes for a model without a task type, the
    `auto_mapping` to transformers' class of the architecture (for `AutoPeftModel`), when transformers has one."""
    arch = str((hf_config.get("architectures") or [""])[0])
    if arch.endswith("ForCausalLM"):
        return {"task_type": "CAUSAL_LM"}
    import transformers

    if arch and hasattr(transformers, arch):
        return {"task_type": None, "auto_mapping": {"base_model_class": arch, "parent_library": "transformers"}}
    return {"task_type": None}


def read_peft_adapter(path: Union[str, Path], hf_config: dict) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config dict, our module name -> (lora_A, lora_B)) of a PEFT LoRA folder.

    Refuses (ValueError) factors holding NaN or inf, and what we cannot reproduce: a non-LoRA adapter, DoRA, per-module ranks /
    alphas, trained biases or extra saved modules, and tensors that name no layer of the model."""
    path = Path(path)
    if not is_peft_adapter(path):
        raise FileNotFoundError(f"{path}: not a PEFT adapter folder (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters are read")
    for key, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(key, ok) != ok:
            raise ValueError(f"{path}: {key} = {config.get(key)!r} is not supported (expected {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is set ({config[key]!r}); per-module ranks / alphas and saved "
                             "modules are not supported")
    raw: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 -- safe_open handles are not iterable
            m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.default)?\.weight", key)
            if m is None:
                raise ValueError(f"{path}: tensor {key} is not a LoRA factor")
            raw.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(key)
    names = PeftNames(hf_config)
    factors = {}
    for peft, parts in sorted(raw.items()):
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: {peft} has only {sorted(parts)}")
        a, b = parts["lora_A"], parts["lora_B"]
        ours = names.to_ours(peft, (b.shape[0], a.shape[1]))
        if ours is None:
            raise ValueError(f"{path}: {peft} names no single layer of this {names.model_type} model")
        factors[ours] = (a, b)
    # a NaN lora_B makes every output garbage (evaluation) or a non-finite merged model (--merge): refused
    check_finite(_named(factors), f"{path}: the LoRA adapter is unusable")
    return config, factors
