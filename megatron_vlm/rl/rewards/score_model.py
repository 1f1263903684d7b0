"""A sequence-classification model: one of our family backbones with a scalar (or n-class) head on the last token.

Why our backbone and not transformers' class: the reward model then runs on every family we load (the VLMs
have no transformers `...ForSequenceClassification`), with the packed, vision-aware forward of training, and
a transformers checkpoint of a text family (`Qwen2ForSequenceClassification`, `Qwen3ForSequenceClassification`)
loads as is. The folder layout is transformers': config.json names a `...ForSequenceClassification`
architecture and `num_labels` (or `id2label`), the backbone's tensors keep their causal-LM names, the head is
`score.weight` [num_labels, hidden] (`score.bias` if any). An `lm_head.weight` in the folder (a causal LM
given a head) is not used and not loaded.

Pooling is transformers': the logits of the last token of each sequence (transformers takes the last
non-padding token; sequences here are packed, never padded, so it is the last token). The head runs in
float32 on the backbone's final-norm hidden states.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from megatron_vlm.checkpoint.score_folder import write_score_files
from megatron_vlm.data.batch import model_inputs
from megatron_vlm.training.reward.model import NoLMHead

__all__ = ["SequenceScoreModel", "load_score_model", "save_score_model", "score_architecture_refusal",
           "score_num_labels"]

_HEAD_KEYS = ("score.weight", "score.bias")


def score_num_labels(hf_config: dict) -> int:
    """The head's width as transformers reads it: `num_labels`, else the size of `id2label`, else 2."""
    if hf_config.get("num_labels") is not None:
        return int(hf_config["num_labels"])
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return 2


class SequenceScoreModel(nn.Module):
    """`backbone` (a family model, its `lm_head` replaced by nothing) + `score` (Linear hidden -> num_labels)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, num_labels: int, *, bias: bool = False):
        super().__init__()
        self.backbone: Any = backbone
        self.score = nn.Linear(hidden_size, num_labels, bias=bias, dtype=torch.float32)

    def forward(self, batch: dict) -> torch.Tensor:
        """Logits [n, num_labels] (float32) of the n sequences of a packed batch (`cu_seqlens`), or of the
        rows of a padded batch (`attention_mask`, left or right padding: the last real token of each row, as
        transformers pools)."""
        hidden = self.backbone(**model_inputs(batch), return_hidden=True)
        if batch.get("cu_seqlens") is not None:
            last = batch["cu_seqlens"][1:].to(hidden.device, torch.long) - 1
            pooled = hidden[0, last]
        else:
            mask = batch.get("attention_mask")
            rows, width = hidden.shape[0], hidden.shape[1]
            if mask is None:
                last = torch.full((rows,), width - 1, device=hidden.device)
            else:  # the highest position with mask 1 (mask.sum() - 1 is only that under right padding)
                positions = torch.arange(width, device=hidden.device)
                last = (positions * mask.to(hidden.device).bool()).argmax(-1)
            pooled = hidden[torch.arange(rows, device=hidden.device), last]
        return self.score(pooled.float())


class _ScoreAdapter:
    """The family's state-dict adapter for the backbone (`backbone.` prefixed), `score.*` as is, `lm_head.*` dropped."""

    def __init__(self, inner: Any):
        self.inner = inner

    def from_hf(self, hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        head = {k: v for k, v in hf.items() if k in _HEAD_KEYS}
        rest = {k: v for k, v in hf.items() if k not in _HEAD_KEYS and not k.startswith("lm_head.")}
        converted, pending = self.inner.from_hf(rest) if rest else ({}, {})
        return {**{f"backbone.{k}": v for k, v in converted.items()}, **head}, pending

    def default_for(self, key: str, shape: tuple) -> Optional[torch.Tensor]:
        fn = getattr(self.inner, "default_for", None)
        if fn is None or not key.startswith("backbone."):
            return None
        return fn(key[len("backbone."):], shape)


def score_architecture_refusal(hf_config: dict, path: Union[str, Path]) -> Optional[str]:
    """Why the folder `path` with config.json `hf_config` is not a sequence-classification model (None when it is):
    the run's refusal (`load_score_model`), which `--check` reads too (plan/side_models.py)."""
    archs = hf_config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return None
    return (f"{path}: config.json architectures {archs} name no ...ForSequenceClassification model (a reward model "
            "folder has a scalar head, `score.weight`)")


def load_score_model(path: Union[str, Path], *, dtype: torch.dtype = torch.float32,
                     device: Union[torch.device, str] = "cpu") -> SequenceScoreModel:
    """Build and load the sequence-classification folder `path` (see the module docstring); ValueError naming
    what is wrong with a folder that is not one."""
    from megatron_vlm.checkpoint.hf import load_hf_weights, read_hf_config
    from megatron_vlm.models.common.parallel_plan import copy_input_casts
    from megatron_vlm.models.registry import get_family

    path = Path(path)
    hf_config = read_hf_config(path)
    refused = score_architecture_refusal(hf_config, path)
    if refused:
        raise ValueError(refused)
    family = get_family(str(hf_config.get("model_type")))
    args_cls: Any = family.args_cls
    args = args_cls.from_hf_config(hf_config)
    has_bias = _has_key(path, "score.bias")
    with torch.device("meta"):
        backbone = family.model_cls(args, hf_config=hf_config)
        hidden = backbone.lm_head.in_features
        # no [vocab, hidden] matrix: the head is `score` (an empty `weight` of the dtype the vision path reads)
        backbone.lm_head = NoLMHead(backbone.lm_head.weight.dtype)
        model = SequenceScoreModel(backbone, hidden, score_num_labels(hf_config), bias=has_bias)
    model.backbone.to(dtype=dtype)
    model = model.to_empty(device=device)
    load_hf_weights(model, path, _ScoreAdapter(family.state_dict_adapter(args)))
    # in bf16, the casts of training's mixed precision (the rotary tables, made in fp32, reach the layers in bf16, as
    # transformers' bf16 models take them): a folder exported by reward-model training scores what training scored
    copy_input_casts(model.backbone, dtype)
    return model.eval().requires_grad_(False)


def _has_key(path: Path, key: str) -> bool:
    from safetensors import safe_open

    from megatron_vlm.checkpoint.hf import safetensors_files

    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as reader:
            if key in reader.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                return True
    return False


def save_score_model(model: SequenceScoreModel, path: Union[str, Path], *, copy_from: Optional[Union[str, Path]] = None,
                     architecture: Optional[str] = None) -> Path:
    """Write `model` in the layout `load_score_model` reads (one model.safetensors, config.json with the
    architecture and `num_labels`, the tokenizer / processor files of `copy_from`). For tests and scripts that
    train a small reward model; the folder is written in place."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    backbone = model.backbone
    write_score_files(path, backbone, {k: v.detach().cpu() for k, v in backbone.state_dict().items()},
                      {k: v.detach().cpu() for k, v in model.score.state_dict().items()}, copy_from=copy_from,
                      architecture=architecture)
    return path
