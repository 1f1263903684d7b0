"""Model families by `model_type` (the field of a Hugging Face config.json).

Each family package has a `family` module exposing `FAMILY`, a `ModelFamily` naming its args class,
module class, state-dict adapter and parallelize function. `_FAMILY_MODULES` is a fixed table (one line per
family, imported lazily so that using one family never imports the others).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

_FAMILY_MODULES = {
    "qwen2_5_vl": "megatron_vlm.models.qwen2_5_vl.family",
    "qwen3_vl": "megatron_vlm.models.qwen3_vl.family",
    "qwen3_vl_moe": "megatron_vlm.models.qwen3_vl.family",
    "internvl": "megatron_vlm.models.internvl.family",
    "internvl_chat": "megatron_vlm.models.internvl.family",
    "nemotron_h": "megatron_vlm.models.nemotron_vl.family",
    "nemotron_h_omni": "megatron_vlm.models.nemotron_vl.family",
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


def supported_model_types() -> list[str]:
    return sorted(_FAMILY_MODULES)


def get_family(model_type: str) -> ModelFamily:
    if model_type not in _FAMILY_MODULES:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; known: {', '.join(supported_model_types())}"
        )
    return importlib.import_module(_FAMILY_MODULES[model_type]).FAMILY


def family_for_args(args: Any) -> ModelFamily:
    for model_type in _FAMILY_MODULES:
        family = get_family(model_type)
        if isinstance(args, family.args_cls):
            return family
    raise ValueError(f"no registered model family takes args of type {type(args).__name__}")
