"""The layout record of a resume checkpoint (`layout.json` beside the shards) and the check at resume.

Why: a checkpoint holds the parameters under the names and shapes the writing run's settings gave
them. `parallel.backend` ("native" / "mcore" decoder layers), `[lora]` (adapter factors, and an optimizer
state that covers only them), `lora.r`, the adapted layers, the model itself and, with full fine-tuning,
`train.train_layers` (the parameters with optimizer state) decide those names and shapes. `train.mode` is
recorded too: a checkpoint of another job kind (an SFT checkpoint named in a DPO run's checkpoint.resume) may
load, but as the continuation of a run it is not (the data position of other samples, a DPO reference that is
not the weights the policy resumes with); its weights start a new run through model.path instead. A run whose settings differ used to fail deep inside DCP with "Missing key in checkpoint
state_dict: ..." — true, but it did not say which setting differs, what it was, or what to do. So every
checkpoint records these settings (`run_layout`, written by rank 0 with the shards) and a resume compares
them with the run's before any shard is read (`layout_refusals`, `adapter_refusal`, `trained_refusal`): a
difference ends the run (exit 2) with the key, the checkpoint's value, this run's value and the way out.

Only settings whose change cannot load are refused. Data-parallel size, native tp / cp / pp (DCP reshards
the global tensors) and `lora.alpha` (a scaling, not a shape) change freely; `train.train_layers` may train
fewer parameters than the checkpoint has optimizer state for, not others. The megatron-core tp / ep
sizes are recorded too and checked with their own rules (models/mcore/tp_shard.py, ep_shard.py). The
parallel sizes are written for information.

The model's sizes are compared too, from the tensor shapes of the DCP metadata (`shape_refusal`): a `model.path` of
the same model type but other sizes (a 7B folder for a 3B run's checkpoint) failed inside DCP with "Size mismatch",
reported as a checkpoint that could not be loaded, to "remove or repair", when the checkpoint is fine.

A checkpoint without the record (written before it existed) loads as before; if it then fails, the error
says that the checkpoint predates the record (`PREDATES`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

__all__ = ["LAYOUT_FILE", "PREDATES", "run_layout", "write_layout", "read_layout", "layout_refusals",
           "checkpoint_adapters", "run_adapters", "adapter_refusal", "checkpoint_trained", "trained_refusal",
           "checkpoint_shapes", "shape_refusal"]

LAYOUT_FILE = "layout.json"
FORMAT = 1
PREDATES = (f"this checkpoint predates the layout record ({LAYOUT_FILE}), so the settings it was written with are "
            "unknown: if its run's parallel.backend, [lora] section, lora.r or model differ from this run's, that shows "
            "only as missing or mismatched keys")

_LORA_A = ".lora_A."
PIXEL_LIMIT_KEYS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")
"""The [data] pixel limits an export writes into the processor configs (checkpoint/export.py `data_pixel_limits`)."""


def run_layout(cfg: Any, *, model_type: Optional[str], world_size: int, mcore_tp: Optional[int],
               mcore_ep: Optional[int]) -> dict:
    """The record of a run's layout-defining settings (`cfg`: the job config; sections it lacks take their
    defaults)."""
    parallel, lora = getattr(cfg, "parallel", None), getattr(cfg, "lora", None)
    out: dict[str, Any] = {
        "format": FORMAT,
        "model_type": model_type,
        "model.path": str(cfg.model.path),
        "parallel.backend": getattr(parallel, "backend", "native"),
        "lora": None if lora is None else {
            "r": lora.r, "alpha": lora.alpha, "use_rslora": lora.use_rslora,
            "target_modules": list(lora.target_modules), "include_vision": lora.include_vision,
            # the weights the factors were trained on: base + init_from folded in, with init_from_mode = "merge"
            "init_from": getattr(lora, "init_from", ""), "init_from_mode": getattr(lora, "init_from_mode", "continue")},
        "train.train_layers": list(getattr(getattr(cfg, "train", None), "train_layers", [])),
        "train.mode": getattr(getattr(cfg, "train", None), "mode", None),
        "sizes": {"world_size": world_size, **{k: getattr(parallel, k, 1) for k in ("tp", "cp", "ep", "pp")}},
    }
    # what the run's own export writes (checkpoint conversion reads them here rather than from the run folder's
    # config.toml, which a later job in the same folder rewrites): the weights' dtype, the export dtype, the limits
    # (each where the config has it)
    if hasattr(cfg.model, "dtype"):
        out["model.dtype"] = cfg.model.dtype
    if hasattr(getattr(cfg, "checkpoint", None), "export_dtype"):
        out["checkpoint.export_dtype"] = cfg.checkpoint.export_dtype
    if getattr(cfg, "data", None) is not None:
        out["data.pixel_limits"] = {k: getattr(cfg.data, k, None) for k in PIXEL_LIMIT_KEYS}
    if mcore_tp is not None:  # the megatron-core layers' own layout (tp_shard.py / ep_shard.py)
        out["mcore_tp"], out["mcore_ep"] = mcore_tp, mcore_ep
    return out


def write_layout(folder: Path, layout: dict) -> None:
    """Write the record into a checkpoint folder being saved (fsynced, like the shards)."""
    with open(folder / LAYOUT_FILE, "w") as f:
        json.dump(layout, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_layout(folder: Path) -> Optional[dict]:
    """The record of a checkpoint folder; None when it has none (written before the record existed).
    Raises ValueError when the file is unreadable (treated like a corrupt checkpoint)."""
    path = folder / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        layout = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable layout record: {e}") from None
    if not isinstance(layout, dict) or not isinstance(layout.get("format"), int):
        raise ValueError(f"{path}: not a layout record")
    return layout


def _v(x: Any) -> str:
    """A value as it is written in the TOML config."""
    return json.dumps(x)


def _new_run(how: str) -> str:
    return f"or start a new run (another train.output_dir, checkpoint.resume = \"none\") from its weights with {how}"


def _hf_folder(saved: dict, ckpt: Path, *, merged: bool) -> str:
    """Where a Hugging Face folder of the checkpoint's weights comes from (launch/convert_checkpoint.py converts
    native and megatron-core layers alike)."""
    return (f"model.path = a Hugging Face folder of it (python launch/convert_checkpoint.py --checkpoint {ckpt}"
            + (" --merge" if merged else "") + " --out DIR" + ("; the adapter merged in" if merged else "") + ")")


def layout_refusals(saved: dict, now: dict, ckpt: Path) -> list[str]:
    """Why the run with layout `now` cannot load checkpoint `ckpt` (recorded layout `saved`): one message per
    differing setting, each starting with its key (empty: the settings agree)."""
    out = []
    t_saved, t_now = saved.get("train.mode"), now.get("train.mode")
    if t_saved and t_now and t_saved != t_now:
        out.append(f"train.mode: {ckpt} was written by a train.mode = {_v(t_saved)} run, this run is {_v(t_now)}; a "
                   "checkpoint continues the run that wrote it (its data position and step count; a DPO run's reference "
                   "is its own initial model). Set train.mode = " + _v(t_saved) + " to resume it, "
                   + _new_run(_hf_folder(saved, ckpt, merged=saved.get("lora") is not None)))
    m_saved, m_now = saved.get("model_type"), now.get("model_type")
    if m_saved and m_now and m_saved != m_now:
        out.append(f"model.path: {ckpt} was written for a {_v(m_saved)} model (model.path = {_v(saved.get('model.path'))}), "
                   f"this run's model.path ({_v(now.get('model.path'))}) is a {_v(m_now)} model. Set model.path to the "
                   "model the checkpoint was trained from to resume it, or set checkpoint.resume to a checkpoint of this "
                   "model")
    b_saved, b_now = saved.get("parallel.backend", "native"), now.get("parallel.backend", "native")
    if b_saved != b_now:
        out.append(f"parallel.backend: {ckpt} was written with parallel.backend = {_v(b_saved)}, this run has "
                   f"parallel.backend = {_v(b_now)}; the two backends store the decoder layers under different "
                   f"parameter names. Set parallel.backend = {_v(b_saved)} to resume it, "
                   + _new_run(_hf_folder(saved, ckpt, merged=False)))
    l_saved, l_now = saved.get("lora"), now.get("lora")
    if l_saved is None and l_now is not None:
        out.append(f"lora: {ckpt} is a full fine-tuning checkpoint (written without a [lora] section), this run has "
                   f"[lora] (r = {l_now['r']}); the checkpoint holds no adapter factors. Remove [lora] to resume it, "
                   + _new_run(_hf_folder(saved, ckpt, merged=False)) + " and [lora]")
    elif l_saved is not None and l_now is None:
        out.append(f"lora: {ckpt} is a LoRA checkpoint (written with [lora] r = {l_saved['r']}, target_modules = "
                   f"{_v(l_saved['target_modules'])}, include_vision = {_v(l_saved['include_vision'])}), this run has no "
                   "[lora] section (full fine-tuning); its optimizer state covers the adapters only. Add that [lora] "
                   "section to resume it, " + _new_run(_hf_folder(saved, ckpt, merged=True)))
    elif l_saved is not None and l_saved["r"] != l_now["r"]:
        out.append(f"lora.r: {ckpt} was written with lora.r = {l_saved['r']}, this run has lora.r = {l_now['r']}; the "
                   f"adapter factors are r wide. Set lora.r = {l_saved['r']} to resume it, "
                   + _new_run(_hf_folder(saved, ckpt, merged=True)) + " and a new adapter")
    return out


def checkpoint_adapters(metadata_keys: Iterable[str]) -> set[str]:
    """The adapted layers (state-dict prefixes) of a checkpoint, from its DCP metadata keys (the model's
    entries are flattened as "model.<state-dict key>")."""
    return {k[len("model."):].split(_LORA_A)[0] for k in metadata_keys if k.startswith("model.") and _LORA_A in k}


def run_adapters(state_dict_keys: Iterable[str]) -> set[str]:
    """The adapted layers (state-dict prefixes) of a model, from its state-dict keys."""
    return {k.split(_LORA_A)[0] for k in state_dict_keys if _LORA_A in k}


def _some(names: set[str], n: int = 3) -> str:
    s = sorted(names)
    return ", ".join(s[:n]) + (f" and {len(s) - n} more" if len(s) > n else "")


def adapter_refusal(saved: dict, now: dict, in_ckpt: set[str], in_run: set[str], ckpt: Path) -> Optional[str]:
    """Refuse a LoRA checkpoint whose adapted layers differ from the run's (`lora.target_modules` /
    `lora.include_vision` resolved differently): layers adapted only now have no factors to load, and
    factors of layers adapted only in the checkpoint would be dropped silently. None: the same layers."""
    if in_ckpt == in_run:
        return None
    l_saved, l_now = saved["lora"], now["lora"]
    only = "; ".join(part for part in (
        f"only in the checkpoint: {_some(in_ckpt - in_run)}" if in_ckpt - in_run else "",
        f"only in this run: {_some(in_run - in_ckpt)}" if in_run - in_ckpt else "") if part)
    how = ("lora.init_from = its adapter (the run's adapter/ folder, or python launch/convert_checkpoint.py "
           f"--checkpoint {ckpt} --out DIR) and lora.init_from_mode = \"merge\"")
    return (f"lora.target_modules: {ckpt} has adapters on {len(in_ckpt)} layers, this run on {len(in_run)} ({only}); it "
            f"was written with lora.target_modules = {_v(l_saved['target_modules'])}, lora.include_vision = "
            f"{_v(l_saved['include_vision'])}, this run has lora.target_modules = {_v(l_now['target_modules'])}, "
            f"lora.include_vision = {_v(l_now['include_vision'])}. Set them as they were to resume it, " + _new_run(how))


def checkpoint_trained(metadata_keys: Iterable[str]) -> set[str]:
    """The parameters with optimizer state in a checkpoint, from its DCP metadata keys
    ("optim.state.<parameter>.<state name>")."""
    return {k[len("optim.state."):].rsplit(".", 1)[0] for k in metadata_keys if k.startswith("optim.state.")}


def trained_refusal(saved: dict, now: dict, in_ckpt: set[str], in_run: set[str], ckpt: Path) -> Optional[str]:
    """Refuse a full fine-tuning checkpoint without optimizer state for parameters this run trains
    (`train.train_layers` widened; training fewer parameters loads). None: it has state for all of them."""
    missing = in_run - in_ckpt
    if not missing:
        return None
    return (f"train.train_layers: {ckpt} holds optimizer state for {len(in_ckpt)} parameters, this run trains "
            f"{len(in_run)}, {len(missing)} of them with no state in it ({_some(missing)}); it was written with "
            f"train.train_layers = {_v(saved.get('train.train_layers'))}, this run has train.train_layers = "
            f"{_v(now.get('train.train_layers'))}. Set train.train_layers as it was (or to a subset) to resume it, "
            + _new_run(_hf_folder(saved, ckpt, merged=False)))


def checkpoint_shapes(metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The model tensors of a checkpoint (state-dict keys) and their global shapes, from its DCP metadata (the
    model's entries are flattened as "model.<state-dict key>"; non-tensor entries left out)."""
    return {k[len("model."):]: tuple(m.size) for k, m in metadata.items()
            if k.startswith("model.") and hasattr(m, "size") and hasattr(m, "chunks")}  # TensorStorageMetadata


def shape_refusal(saved: dict, now: dict, in_ckpt: dict[str, tuple[int, ...]], in_run: dict[str, tuple[int, ...]],
                  ckpt: Path) -> Optional[str]:
    """Refuse a checkpoint whose model tensors have other shapes than this run's of the same name (`model.path` a
    model of other sizes). None: the shapes agree, or the megatron-core layout is involved (its tensors are laid out
    per tp / ep rank, checked by their own rules)."""
    if "mcore" in (saved.get("parallel.backend"), now.get("parallel.backend")):
        return None
    differ = sorted(k for k in in_ckpt.keys() & in_run.keys() if tuple(in_ckpt[k]) != tuple(in_run[k]))
    if not differ:
        return None
    k = differ[0]
    return (f"model.path: {ckpt} was written for a model of other sizes (model.path = {_v(saved.get('model.path'))}) "
            f"than this run's model.path ({_v(now.get('model.path'))}): {len(differ)} tensor(s) differ, e.g. {k} is "
            f"{list(in_ckpt[k])} in the checkpoint and {list(in_run[k])} here; the checkpoint itself is fine. Set "
            "model.path to the model the checkpoint was trained from to resume it, or set checkpoint.resume to a "
            "checkpoint of this model")
