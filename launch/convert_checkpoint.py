#!/usr/bin/env python
"""Convert a distributed training checkpoint to a Hugging Face folder (on demand; runs also export
at the end). One process, CPU. What the checkpoint holds (the model path, LoRA or not, its r / alpha /
rsLoRA) is read from its own `layout.json`, written with the shards; the run's config.toml beside
`checkpoints/` is read for what the layout record does not hold (a checkpoint written before that record existed or
before it held the dtypes and pixel limits below; the adapter dropout it notes), so an edited or overwritten
config.toml (a later job in the same run folder rewrites it) changes neither which weights are exported nor, for a
checkpoint whose record holds them, their dtype and the processor limits.

    python launch/convert_checkpoint.py --checkpoint runs/demo_sft/checkpoints/step_100 --out /tmp/hf

A checkpoint of a `parallel.backend = "mcore"` run (its decoder layers under megatron-core's names, written
under any parallel.tp / parallel.ep) is converted to the same folder as the run's own export.

A reward-model run's checkpoint (`train.mode = "reward"`) is written as the `...ForSequenceClassification` folder
its run exports at the end (backbone + `score` head: the folder `[[rl.rewards]] type = "model"` loads).

LoRA: a checkpoint of a run with `[lora]` is written as a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors), or with `--merge` as the full model with the adapter folded in. A PEFT
adapter folder (ours or one trained with `peft`) is merged into its base model with

    python launch/convert_checkpoint.py --adapter runs/x/adapter --model-path /ckpt/base --merge --out /tmp/hf

Weights are written in the run's `checkpoint.export_dtype` (from layout.json, else config.toml; unset: as the run held them,
its `model.dtype`, fp32 by default, as the run's own export) or in `--dtype` (float32 / bfloat16 / float16), which
overrides it; an adapter merge (`--adapter`) is written in `--dtype` (default: the base model's, as loaded: fp32).
Tensors kept in fp32 on purpose (MoE routers) stay fp32. A checkpoint's LoRA adapter is written in the run's
`model.dtype`, as the run writes its own; a PEFT adapter folder keeps its own dtype. A run's data pixel limits
(`data.min_pixels` / `max_pixels`, `data.video_*`) are written into the exported processor configs, as the run's
own export does.

Input problems (a checkpoint that is incomplete, unreadable or damaged, a model folder without config.json or of
another size than the checkpoint's, a base model the adapter does not fit, `--out` a file, weights or adapter
factors holding NaN / inf) exit 2 with one `error:` line; nothing is written then.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


_INPUT_ERRORS = (OSError, ValueError, KeyError, RuntimeError)
"""What a bad input raises while reading or writing (missing files, mismatched shapes / names, NaN)."""


_DTYPES = ("float32", "bfloat16", "float16")


def _export_dtype(name):
    """A dtype name (`--dtype`, `checkpoint.export_dtype`) as a torch dtype (None: as held)."""
    import torch

    return None if name is None else getattr(torch, name)


def _merge_adapter(adapter: Path, model_path: str, out: str, dtype=None) -> int:
    """Base folder + PEFT adapter folder -> merged Hugging Face folder."""
    from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
    from megatron_vlm.config.sections import LoRAConfig
    from megatron_vlm.training.lora import setup_lora

    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        return _error(f"--adapter: {adapter} is not a readable PEFT adapter folder ({e})")
    try:
        model = load_hf_model(model_path, device="cpu")
    except _INPUT_ERRORS as e:
        return _error(f"--model-path: cannot load {model_path} as the base model: {e}")
    lora = LoRAConfig(r=int(cfg.get("r", 8)), alpha=float(cfg.get("lora_alpha", 8)),
                      use_rslora=bool(cfg.get("use_rslora", False)), init_from=str(adapter))
    try:
        setup_lora(model, lora, model.hf_config, training=False)
        save_hf_model(model, out, copy_from=model_path, dtype=_export_dtype(dtype))  # adapters: written merged
    except _INPUT_ERRORS as e:
        return _error(f"cannot merge {adapter} into {model_path}: {e}")
    print(f"wrote {out} (merged {adapter} into {model_path})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split(". ", 1)[0].split()) + ".")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoints/step_<N> folder")
    src.add_argument("--adapter", help="a PEFT LoRA adapter folder to merge into --model-path (needs --merge)")
    p.add_argument("--out", required=True, help="output folder (Hugging Face model, or PEFT adapter)")
    p.add_argument("--model-path", default=None, help="source HF folder (default: the model.path in the checkpoint's layout.json; older checkpoints: the run's config.toml)")
    p.add_argument("--merge", action="store_true", help="LoRA: write the full model with the adapter merged in")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="dtype of the written weights (default: the run's checkpoint.export_dtype from its config.toml; "
                        "unset there: its model.dtype, as the run's own export; for --adapter: float32); tensors kept in float32 on purpose stay so")
    a = p.parse_args(argv)

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        return _error(f"--out: {out} is a file; name a folder (created, or replaced when complete)")
    if a.model_path is not None and not (Path(a.model_path) / "config.json").is_file():
        return _error(f"--model-path: {a.model_path} has no config.json (not a Hugging Face model folder)")
    if a.adapter is not None:
        if not a.merge or a.model_path is None:
            return _error("--adapter needs --merge and --model-path (the base model the adapter was trained on)")
        return _merge_adapter(Path(a.adapter), a.model_path, a.out, a.dtype)
    try:
        return _convert_checkpoint(Path(a.checkpoint), a.model_path, a.out, merge=a.merge, dtype=a.dtype)
    except _INPUT_ERRORS as e:
        return _error(f"cannot convert {a.checkpoint}: {e}")


def _convert_checkpoint(ckpt: Path, model_path, out: str, *, merge: bool, dtype=None) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_vlm.checkpoint.export import data_pixel_limits, export_hf_from_state_dict
    from megatron_vlm.checkpoint.hf import describe_error
    from megatron_vlm.checkpoint.layout import read_layout
    from megatron_vlm.checkpoint.manager import MARKER
    from megatron_vlm.config.loader import ConfigError, from_dict
    from megatron_vlm.config.sections import LoRAConfig
    from megatron_vlm.finite import check_finite
    from megatron_vlm.models import build_model
    from megatron_vlm.models.common.lora import merged_state_dict
    from megatron_vlm.training.lora import scaling_of, select_lora_targets, write_adapter

    if not (ckpt / MARKER).is_file():
        return _error(f"--checkpoint: {ckpt} is not a complete checkpoint (no {MARKER} marker)")
    if not (ckpt / ".metadata").is_file():
        return _error(f"--checkpoint: {ckpt} has no .metadata (the DCP index): the checkpoint is damaged; "
                      "convert an earlier one")
    layout = read_layout(ckpt)  # ValueError when unreadable: reported as an input error
    cfg_file = ckpt.parent.parent / "config.toml"
    try:
        run_cfg = tomllib.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        if layout is None:
            return _error(f"{cfg_file}: unreadable ({e}); pass --model-path")
        run_cfg = {}
    recorded = layout or {}  # the settings saved with the checkpoint, where its record holds them
    if dtype is None:  # the run's checkpoint.export_dtype, as its own export used
        dtype = (recorded["checkpoint.export_dtype"] if "checkpoint.export_dtype" in recorded
                 else (run_cfg.get("checkpoint") or {}).get("export_dtype"))
        if dtype is not None and dtype not in _DTYPES:
            return _error(f"{cfg_file}: checkpoint.export_dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}; "
                          "pass --dtype")
    # the dtype the run held its weights in (model.dtype)
    held = recorded["model.dtype"] if "model.dtype" in recorded else (run_cfg.get("model") or {}).get("dtype")
    if held is not None and held not in _DTYPES:
        return _error(f"{cfg_file}: model.dtype: expected one of {', '.join(_DTYPES)}, got {held!r}")
    held = None if held == "float32" else held
    data = recorded["data.pixel_limits"] if "data.pixel_limits" in recorded else run_cfg.get("data")
    pixel_limits = data_pixel_limits(SimpleNamespace(**data) if isinstance(data, dict) else None)
    if model_path is None:
        model_path = (layout or {}).get("model.path") or run_cfg.get("model", {}).get("path")
        if not model_path:
            return _error(f"{ckpt} has no {'layout.json' if layout is None else 'model.path in layout.json'} "
                          f"and {cfg_file} names no model; pass --model-path")
        if not (Path(model_path) / "config.json").is_file():
            return _error(f"--model-path: the checkpoint's model {model_path} has no config.json; pass --model-path")
    lora = None
    if layout is not None:  # what the checkpoint holds, whatever config.toml says now
        if layout.get("lora") is not None:
            rec = layout["lora"]
            dropout = float(run_cfg.get("lora", {}).get("dropout", 0.0))  # only noted in the adapter's config
            # init_from / init_from_mode: recorded since the merge-mode adapter fix; older records: config.toml's
            lora = LoRAConfig(r=int(rec["r"]), alpha=float(rec["alpha"]), dropout=dropout,
                              use_rslora=bool(rec["use_rslora"]), target_modules=list(rec["target_modules"]),
                              include_vision=bool(rec["include_vision"]),
                              init_from=str(rec.get("init_from", run_cfg.get("lora", {}).get("init_from", ""))),
                              init_from_mode=rec.get("init_from_mode",
                                                     run_cfg.get("lora", {}).get("init_from_mode", "continue")))
    elif "lora" in run_cfg:
        try:
            lora = from_dict(LoRAConfig, run_cfg["lora"])
        except ConfigError as e:
            return _error(f"{cfg_file}: [lora]: {e}")
    if lora is None and merge:
        return _error(f"--merge: {ckpt} holds no LoRA adapter (a full model); convert it without --merge")
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    model = build_model(hf_config, device="cpu")
    if held is not None:  # as the run held its weights (load_hf_model in model.dtype): its export, merge and adapter
        model.to(dtype=_export_dtype(held))  # are written from them as held; a reward model's head stays fp32
    if lora is None and _holds_score_head(ckpt):  # a reward-model run's (train.mode = "reward")
        return _convert_reward_checkpoint(ckpt, model, model_path, out, dtype, pixel_limits)
    if lora is not None:
        # the layers that hold factors in the checkpoint (the same as in training, init_from's included)
        from megatron_vlm.models.common.lora import apply_lora

        targets = _checkpoint_lora_modules(ckpt) or list(select_lora_targets(
            model, hf_config, lora.target_modules, include_vision=lora.include_vision))
        apply_lora(model, targets, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, use_rslora=lora.use_rslora)
    mcore = _mcore_layout(ckpt, layout)
    if mcore is None:
        state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    else:  # the checkpoint's global tensors, allocated from its metadata (expert shapes depend on parallel.ep)
        state = {"model": _stored_tensors(ckpt, "model.model.")}
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        return _error(f"cannot read {ckpt} into the model of {model_path} (another size than the checkpoint's, or a "
                      f"damaged shard): {describe_error(e)}")
    sd = {k[len("model."):]: v for k, v in state["model"].items()}
    if mcore is not None:
        sd = _mcore_to_native(sd, model, *mcore)
    check_finite(sd, f"{ckpt}: the checkpoint is corrupt")
    if lora is not None and not merge:
        write_adapter(Path(out), sd, hf_config, lora, base_model_name_or_path=str(model_path))
        print(f"wrote {out} (PEFT adapter; --merge writes the merged model)")
        return 0
    if lora is not None:
        sd = merged_state_dict(sd, scaling_of(lora))
    export_hf_from_state_dict(sd, model_path, out, dtype=_export_dtype(dtype), pixel_limits=pixel_limits)
    print(f"wrote {out}" + (f" ({dtype})" if dtype else ""))
    return 0


def _mcore_layout(ckpt: Path, layout) -> tuple[int, int] | None:
    """(tp, ep) the megatron-core layers of a `parallel.backend = "mcore"` checkpoint were saved with (their fc1
    rows and expert tensors are laid out per rank of them, models/mcore/tp_shard.py / ep_shard.py); None for a
    checkpoint of native layers."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    if (layout or {}).get("parallel.backend") != "mcore" and not any(".mcore." in k for k in keys):
        return None
    return int((layout or {}).get("mcore_tp") or 1), int((layout or {}).get("mcore_ep") or 1)


def _stored_tensors(ckpt: Path, prefix: str) -> dict:
    """Empty tensors of the checkpoint's own shapes and dtypes for its tensors under `prefix` (DCP's flattened
    names), keyed as `dcp.load` is given them under the top-level key (`prefix` less its first part)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    top = prefix.split(".", 1)[0] + "."
    return {k[len(top):]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in keys.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata) and not k.endswith("_extra_state")}


def _mcore_to_native(sd: dict, model, tp: int, ep: int) -> dict:
    """The state of a `parallel.backend = "mcore"` checkpoint (megatron-core layer names, global tensors saved
    under tensor / expert parallel sizes `tp` / `ep`) -> native names and full tensors, as the run's own export
    converts it (`native_state_dict`). `model`: the native model (LoRA applied as in the run); its decoder layers
    are swapped for megatron-core ones here (one process: a gloo group of one is set up for megatron-core)."""
    import tempfile

    import torch.distributed as dist

    try:
        from megatron_vlm.models.mcore.layer import McoreDecoderLayer, native_state_dict, use_mcore_layers
    except ImportError as e:
        raise RuntimeError(f"the checkpoint holds megatron-core decoder layers (parallel.backend = \"mcore\"); "
                           f"converting it needs megatron-core, as training did (the \"mcore\" extra): {e}") from None

    own = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if own:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            use_mcore_layers(model)
            fused = any(k.endswith(".linear_qkv.layer_norm_weight") for k in sd)  # written with transformer-engine
            for layer in model.language_model.layers:
                layer.tp = tp
                if layer.is_moe if isinstance(layer, McoreDecoderLayer) else layer.block_type == "moe":
                    layer.ep = ep  # the others are not expert-sharded
                if isinstance(layer, McoreDecoderLayer):
                    layer.te_fused_norms = fused
            return native_state_dict(sd, model)
        finally:
            if own:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()


def _holds_score_head(ckpt: Path) -> bool:
    """Whether the checkpoint is a reward-model run's: a `score` head beside the backbone (training/reward/model.py)."""
    from torch.distributed.checkpoint import FileSystemReader

    return "model.score.weight" in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata


def _convert_reward_checkpoint(ckpt: Path, model, model_path, out: str, dtype=None, pixel_limits=None) -> int:
    """A reward-model checkpoint -> the `...ForSequenceClassification` folder its run exports at the end (the
    folder `[[rl.rewards]] type = "model"` loads), written whole or not at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_vlm.checkpoint.hf import describe_error
    from megatron_vlm.training.reward.export import export_score_folder
    from megatron_vlm.training.reward.model import ScoreRoot

    root = ScoreRoot(model, std=0.0, seed=0)  # the head is read from the checkpoint
    state = {"model": root.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        return _error(f"cannot read {ckpt} into the reward model of {model_path} (another size than the checkpoint's, "
                      f"or a damaged shard): {describe_error(e)}")
    export_score_folder(state["model"], root.model, Path(out), copy_from=model_path,  # refuses NaN / inf
                        dtype=_export_dtype(dtype), pixel_limits=pixel_limits)
    print(f"wrote {out} (reward model: sequence classification, num_labels 1)")
    return 0


def _checkpoint_lora_modules(ckpt: Path) -> list[str]:
    """Our module names that have LoRA factors in a DCP checkpoint (from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix, suffix = "model.model.", ".lora_A.weight"  # DCP flattens {"model": {"model.<name>": ...}}
    return sorted(k[len(prefix):-len(suffix)] for k in keys if k.startswith(prefix) and k.endswith(suffix))


if __name__ == "__main__":
    sys.exit(main())
