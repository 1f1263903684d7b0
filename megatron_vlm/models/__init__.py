"""Model families (architecture only) and `build_model(config)`: random initialisation from a
config.json dict or an args object (tests, the tiny demo model).

Loading a Hugging Face folder with its weights is checkpoint I/O: `megatron_vlm.checkpoint.load_hf_model`
(the checkpoint package depends on the models, never the reverse).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from megatron_vlm.models.registry import ModelFamily, family_for_args, get_family, supported_model_types


def build_model(
    config: Any, *, dtype: torch.dtype = torch.float32, device: Optional[torch.device | str] = None
) -> nn.Module:
    """Randomly initialised model from a config.json dict or a family args object (e.g. `Qwen2_5_VLArgs`).

    `device` None builds on the current default device, so `with torch.device("meta"): build_model(cfg)`
    gives a weightless skeleton (its tied weights tied; nothing drawn).
    """
    if isinstance(config, dict):
        family = get_family(config.get("model_type"))
        args, hf_config = family.args_cls.from_hf_config(config), dict(config)
    else:
        family = family_for_args(config)
        args, hf_config = config, config.to_hf_config()
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = family.model_cls(args, hf_config=hf_config)
    if all(p.is_meta for p in model.parameters()):
        # a skeleton has no values to draw: only the ties (random init on meta tensors still runs torch's Python
        # decompositions, ~1 s for a 30B MoE config: most of a `--check`)
        model.tie_weights()
    else:
        model.init_weights()
    return model.to(dtype=dtype)


__all__ = ["ModelFamily", "build_model", "get_family", "supported_model_types"]
