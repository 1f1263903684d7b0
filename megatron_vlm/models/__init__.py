"""Model families and the two entry points to get a model.

* `load_hf_model(path, dtype, device)`: a Hugging Face model folder -> our module with its weights
  (family chosen by config.json's `model_type`, built on the meta device, safetensors streamed
  tensor by tensor so peak host memory stays near one copy of the weights).
* `build_model(config)`: random initialisation from a config.json dict or an args object (tests,
  the tiny demo model).
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
    gives a weightless skeleton.
    """
    if isinstance(config, dict):
        family = get_family(config.get("model_type"))
        args, hf_config = family.args_cls.from_hf_config(config), dict(config)
    else:
        family = family_for_args(config)
        args, hf_config = config, config.to_hf_config()
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = family.model_cls(args, hf_config=hf_config)
    model.init_weights()
    return model.to(dtype=dtype)


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """Model + weights from a Hugging Face folder; returned on `device` in `dtype` (train/eval left to the caller)."""
    from megatron_vlm.checkpoint.hf import load_hf_model as _load

    return _load(path, dtype=dtype, device=device)


__all__ = ["ModelFamily", "build_model", "get_family", "load_hf_model", "supported_model_types"]
