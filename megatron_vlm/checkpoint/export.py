"""Hugging Face export from a gathered (unsharded) state dict in our naming.

Builds the family model on the meta device from the source folder's config, materialises it with
the given tensors and writes it with `save_hf_model`, copying tokenizer / processor / chat-template
files from the source folder — so transformers, vLLM and VLMEvalKit load the export unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from megatron_vlm.checkpoint.hf import save_hf_model
from megatron_vlm.models import build_model


def export_dtype(checkpoint_cfg) -> Optional[torch.dtype]:
    """`checkpoint.export_dtype` as a torch dtype (None: the weights' own)."""
    return None if checkpoint_cfg.export_dtype is None else getattr(torch, checkpoint_cfg.export_dtype)


def data_pixel_limits(data_cfg) -> dict[str, Optional[int]]:
    """The [data] section's pixel limits (None: the model folder's), as `save_hf_model` takes them."""
    from megatron_vlm.checkpoint.layout import PIXEL_LIMIT_KEYS

    return {k: getattr(data_cfg, k, None) for k in PIXEL_LIMIT_KEYS} if data_cfg is not None else {}


def export_hf_from_state_dict(state_dict: dict[str, torch.Tensor], src_model_dir: str | Path, out_dir: str | Path,
                              *, dtype: Optional[torch.dtype] = None,
                              pixel_limits: Optional[dict[str, Optional[int]]] = None) -> None:
    """`dtype`: the exported weights' (`checkpoint.export_dtype`; None = as given); `pixel_limits`: the run's
    (`data_pixel_limits`), written into the exported processor configs."""
    src_model_dir = Path(src_model_dir)
    hf_config = json.loads((src_model_dir / "config.json").read_text())
    with torch.device("meta"):
        model = build_model(hf_config)
    model.load_state_dict(state_dict, assign=True, strict=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    save_hf_model(model, out_dir, copy_from=src_model_dir, dtype=dtype, pixel_limits=pixel_limits)
