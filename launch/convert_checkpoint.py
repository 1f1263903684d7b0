#!/usr/bin/env python
"""Convert a distributed training checkpoint to a Hugging Face folder (on demand; runs also export
at the end). One process, CPU; reads the run's config.toml next to `checkpoints/` for the model path
and its `[lora]` section.

    python launch/convert_checkpoint.py --checkpoint runs/demo_sft/checkpoints/step_100 --out /tmp/hf

LoRA: a checkpoint of a run with `[lora]` is written as a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors), or with `--merge` as the full model with the adapter folded in. A PEFT
adapter folder (ours or one trained with `peft`) is merged into its base model with

    python launch/convert_checkpoint.py --adapter runs/x/adapter --model-path /ckpt/base --merge --out /tmp/hf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _merge_adapter(adapter: Path, model_path: str, out: str) -> int:
    """Base folder + PEFT adapter folder -> merged Hugging Face folder."""
    from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
    from megatron_vlm.config.sections import LoRAConfig
    from megatron_vlm.training.lora import setup_lora

    cfg = json.loads((adapter / "adapter_config.json").read_text()) if (adapter / "adapter_config.json").is_file() else {}
    model = load_hf_model(model_path, device="cpu")
    lora = LoRAConfig(r=int(cfg.get("r", 8)), alpha=float(cfg.get("lora_alpha", 8)),
                      use_rslora=bool(cfg.get("use_rslora", False)), init_from=str(adapter))
    try:
        setup_lora(model, lora, model.hf_config)
    except (ValueError, FileNotFoundError) as e:
        return _error(str(e))
    save_hf_model(model, out, copy_from=model_path)  # a model with adapters is written merged
    print(f"wrote {out} (merged {adapter} into {model_path})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoints/step_<N> folder")
    src.add_argument("--adapter", help="a PEFT LoRA adapter folder to merge into --model-path (needs --merge)")
    p.add_argument("--out", required=True, help="output folder (Hugging Face model, or PEFT adapter)")
    p.add_argument("--model-path", default=None, help="source HF folder (default: [model] path of the run's config.toml)")
    p.add_argument("--merge", action="store_true", help="LoRA: write the full model with the adapter merged in")
    a = p.parse_args(argv)

    if a.adapter is not None:
        if not a.merge or a.model_path is None:
            return _error("--adapter needs --merge and --model-path (the base model the adapter was trained on)")
        return _merge_adapter(Path(a.adapter), a.model_path, a.out)

    import torch.distributed.checkpoint as dcp

    from megatron_vlm.checkpoint.export import export_hf_from_state_dict
    from megatron_vlm.checkpoint.manager import MARKER
    from megatron_vlm.config.loader import ConfigError, from_dict
    from megatron_vlm.config.sections import LoRAConfig
    from megatron_vlm.models import build_model
    from megatron_vlm.models.common.lora import merged_state_dict
    from megatron_vlm.training.lora import scaling_of, select_lora_targets, write_adapter

    ckpt = Path(a.checkpoint)
    if not (ckpt / MARKER).is_file():
        return _error(f"{ckpt} is not a complete checkpoint (no {MARKER} marker)")
    cfg_file = ckpt.parent.parent / "config.toml"
    run_cfg = tomllib.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    model_path = a.model_path
    if model_path is None:
        if not run_cfg:
            return _error(f"{cfg_file} not found; pass --model-path")
        model_path = run_cfg["model"]["path"]
    lora = None
    if "lora" in run_cfg:
        try:
            lora = from_dict(LoRAConfig, run_cfg["lora"])
        except ConfigError as e:
            return _error(f"{cfg_file}: [lora]: {e}")
    elif a.merge:
        return _error(f"--merge: the run of {ckpt} has no [lora] section ({cfg_file}); its checkpoint is a full model")
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    model = build_model(hf_config, device="cpu")
    if lora is not None:
        # the layers that hold factors in the checkpoint (the same as in training, init_from's included)
        from megatron_vlm.models.common.lora import apply_lora

        targets = _checkpoint_lora_modules(ckpt) or list(select_lora_targets(
            model, hf_config, lora.target_modules, include_vision=lora.include_vision))
        apply_lora(model, targets, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, use_rslora=lora.use_rslora)
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(ckpt))
    sd = {k[len("model."):]: v for k, v in state["model"].items()}
    if lora is not None and not a.merge:
        write_adapter(Path(a.out), sd, hf_config, lora, base_model_name_or_path=str(model_path))
        print(f"wrote {a.out} (PEFT adapter; --merge writes the merged model)")
        return 0
    if lora is not None:
        sd = merged_state_dict(sd, scaling_of(lora))
    export_hf_from_state_dict(sd, model_path, a.out)
    print(f"wrote {a.out}")
    return 0


def _checkpoint_lora_modules(ckpt: Path) -> list[str]:
    """Our module names that have LoRA factors in a DCP checkpoint (from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix, suffix = "model.model.", ".lora_A.weight"  # DCP flattens {"model": {"model.<name>": ...}}
    return sorted(k[len(prefix):-len(suffix)] for k in keys if k.startswith(prefix) and k.endswith(suffix))


if __name__ == "__main__":
    sys.exit(main())
