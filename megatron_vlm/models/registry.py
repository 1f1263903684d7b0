"""Model families by `model_type` (the field of a Hugging Face config.json).

Every family package has the same four modules: `args` (its args class), `model` (its module class),
`state_dict_adapter` and `parallelize`. `_FAMILIES` names, per family, the package and the four objects; they
are imported lazily, the first time the family is asked for, so using one family never imports the others.
`_MODEL_TYPES` maps each `model_type` to its family (one family may serve several).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# family (= package under megatron_vlm/models/): args class, module class, state-dict adapter, parallelize function
_FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLArgs", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLStateDictAdapter", "parallelize_qwen2_5_vl"),
    "qwen3_vl": ("Qwen3VLArgs", "Qwen3VLForConditionalGeneration", "Qwen3VLStateDictAdapter", "parallelize_qwen3_vl"),
    "internvl": ("InternVLArgs", "InternVLForConditionalGeneration", "InternVLStateDictAdapter", "parallelize_internvl"),
    "nemotron_vl": ("NemotronVLArgs", "NemotronVLForConditionalGeneration", "NemotronVLStateDictAdapter", "parallelize_nemotron_vl"),
    # text-only language models on the Qwen VLMs' decoder (1-D RoPE)
    "qwen_text": ("QwenTextArgs", "QwenTextForCausalLM", "QwenTextStateDictAdapter", "parallelize_qwen_text"),
}
_MODEL_TYPES = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "internvl": "internvl",
    "internvl_chat": "internvl",
    "nemotron_h": "nemotron_vl",
    "nemotron_h_omni": "nemotron_vl",
    "qwen2": "qwen_text",
    "qwen3": "qwen_text",
    "qwen3_moe": "qwen_text",
}


@dataclass(frozen=True)
class ModelFamily:
    """What the generic loader / exporter / trainer need to know about one family.

    args_cls.from_hf_config(dict) -> args; args.to_hf_config() -> dict;
    model_cls(args, hf_config=dict) -> nn.Module with `lm_head`, `transformer_blocks()`,
    `tie_weights()`, `init_weights()`; state_dict_adapter(args) with `from_hf(tensors) -> (ours,
    pending)` and `to_hf(state_dict) -> hf tensors`; parallelize(model, parallel_dims, parallel_cfg, ...).
    """

    name: str
    args_cls: type
    model_cls: type
    state_dict_adapter: Callable[[Any], Any]
    parallelize: Callable[..., Any]


@functools.cache
def _family(name: str) -> ModelFamily:
    """The `ModelFamily` of package `name`, its four modules imported now (once: later calls return the same)."""
    names = dict(zip(("args", "model", "state_dict_adapter", "parallelize"), _FAMILIES[name]))
    found = {sub: getattr(importlib.import_module(f"megatron_vlm.models.{name}.{sub}"), attr) for sub, attr in names.items()}
    return ModelFamily(
        name=name, args_cls=found["args"], model_cls=found["model"], state_dict_adapter=found["state_dict_adapter"],
        parallelize=found["parallelize"],
    )


def supported_model_types() -> list[str]:
    return sorted(_MODEL_TYPES)


def get_family(model_type: str) -> ModelFamily:
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; known: {', '.join(supported_model_types())}"
        )
    return _family(_MODEL_TYPES[model_type])


def family_for_args(args: Any) -> ModelFamily:
    for name in _FAMILIES:
        family = _family(name)
        if isinstance(args, family.args_cls):
            return family
    raise ValueError(f"no registered model family takes args of type {type(args).__name__}")
