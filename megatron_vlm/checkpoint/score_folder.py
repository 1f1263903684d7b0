"""The files of a reward model folder (a transformers `...ForSequenceClassification` layout) from state dicts.

Shared by the scripts and tests that save a `SequenceScoreModel` (rl/rewards/score_model.py) and by the export
of reward-model training (training/reward/export.py). The layout is the one `load_score_model` reads: the
backbone's tensors under the family's transformers names (no lm_head), the head as `score.*`, config.json naming
`<Family>ForSequenceClassification` with `num_labels` / `id2label`, the tokenizer and processor files copied.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import save_file

__all__ = ["write_score_files", "model_folder_refusal"]


def write_score_files(path: Path, backbone: Any, backbone_state: dict[str, torch.Tensor],
                      score_state: dict[str, torch.Tensor], *, copy_from: Optional[Union[str, Path]] = None,
                      architecture: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The files of a reward model folder into the existing folder `path`: `backbone_state` (our names; any
    `lm_head.*` dropped) through the family's adapter of `backbone` (its `args`, `hf_config`), `score_state` as
    `score.*`; returns the tensors written (transformers' names)."""
    from megatron_vlm.checkpoint.hf import _DTYPE_NAMES, _main_dtype, _with_dtype, copy_tokenizer_files
    from megatron_vlm.models.registry import family_for_args

    adapter = family_for_args(backbone.args).state_dict_adapter(backbone.args)
    ours = {k: v.contiguous() for k, v in backbone_state.items() if not k.startswith("lm_head.")}
    tensors = {k: v for k, v in adapter.to_hf(ours).items() if not k.startswith("lm_head.")}
    tensors.update({f"score.{k}": v.contiguous() for k, v in score_state.items()})
    seen: set[int] = set()
    for k, t in list(tensors.items()):  # safetensors refuses shared storage (tied embeddings)
        ptr = t.untyped_storage().data_ptr()
        tensors[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(getattr(backbone, "hf_config", None) or backbone.args.to_hf_config())
    name = _DTYPE_NAMES.get(_main_dtype(tensors))
    if name:  # the dtype written, not the source's: transformers' dtype="auto" and vLLM load in it
        config = {**_with_dtype(config, name), "dtype": name}
    arch = architecture or _classification_architecture(backbone, config)
    n = int(score_state["weight"].shape[0])
    config.update(architectures=[arch], num_labels=n, id2label={str(i): f"LABEL_{i}" for i in range(n)},
                  label2id={f"LABEL_{i}": i for i in range(n)})
    if config.get("pad_token_id") is None and copy_from is not None:
        pad = _tokenizer_pad_token_id(copy_from)
        if pad is not None:  # transformers' ...ForSequenceClassification refuses batches without it
            config["pad_token_id"] = pad
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if copy_from is not None:
        copy_tokenizer_files(copy_from, path)
    return tensors


def _classification_architecture(backbone: Any, config: dict) -> str:
    """`<Family>ForSequenceClassification`: for a causal LM source (`Qwen2ForCausalLM`, ...) the class transformers
    and vLLM have by that name (they pick the class by `architectures`); a vision-language family, which has none,
    is named after our module."""
    source = str((config.get("architectures") or [""])[0])
    if source.endswith("ForSequenceClassification"):  # trained on from a reward model folder
        return source
    if source.endswith("ForCausalLM"):
        return source[: -len("ForCausalLM")] + "ForSequenceClassification"
    return f"{type(backbone).__name__.split('For')[0]}ForSequenceClassification"


def _tokenizer_pad_token_id(folder: Union[str, Path]) -> Optional[int]:
    """The pad token id of the tokenizer in `folder` (None: no tokenizer there, or none set). Qwen2.5 / Qwen3
    config.json files name none while their tokenizers do; a sequence-classification model needs it in its config
    to find each row's last token of a padded batch (transformers refuses batches of more than one without it)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None
    pad = tokenizer.pad_token_id
    return None if pad is None else int(pad)


def model_folder_refusal(hf_config: dict, path: Union[str, Path], mode: str) -> Optional[str]:
    """Why the folder `path` (config.json `hf_config`) cannot be `model.path` of a `train.mode = mode` run, or None:
    a sequence-classification folder (a reward model) has a scalar head where every job reads a causal model's
    lm_head (its weights would stop the load with a traceback), and reward-model training starts from a causal
    folder with a fresh head."""
    archs = hf_config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return None
    if mode == "reward":
        return (f"model.path: {path} is already a sequence-classification folder ({archs[0]}); reward-model training "
                "starts from a causal (SFT) model folder with a fresh head")
    return (f"model.path: {path} is a sequence-classification folder ({archs[0]}, e.g. a reward model): train.mode = "
            f"{mode!r} needs a causal model folder (its lm_head); give the folder it was trained from, or score with it "
            "as [[rl.rewards]] type = \"model\"")
