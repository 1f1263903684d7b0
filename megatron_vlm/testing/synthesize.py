"""`[model] synthesize = "<name>"`: the tiny, deterministic, offline model folders the demos and
tests train (config + random weights + tokenizer + processor files, in the real HF layout).

A folder built here holds `synthesized.json` (the tiny model's name and seed). A run that asks for another
tiny model at a path that holds one (two demo configs sharing a folder, a `--set model.synthesize=...`) is
refused with the key named instead of training the model that is there; a folder without the file (a real
checkpoint, or one built before the file existed) is used as it is, as `model.synthesize` says (it builds
only where nothing is)."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megatron_vlm.errors import ConfigError
from megatron_vlm.testing.tiny_model import build_tiny_model_folder
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_qwen3_vision_folder, build_tiny_nemotron_vl_folder
from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_folder
from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_folder
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder


def _qwen2_5_vl(out: Path, seed: int) -> Path:
    return build_tiny_model_folder("tiny_qwen2_5_vl", out, seed=seed)


def _qwen3_vl(out: Path, seed: int) -> Path:
    return build_tiny_qwen3_vl_folder(out, seed=seed)


def _qwen3_vl_moe(out: Path, seed: int) -> Path:
    return build_tiny_qwen3_vl_folder(out, seed=seed, moe=True)


def _internvl(out: Path, seed: int) -> Path:
    return build_tiny_internvl_folder(out, seed=seed)


def _nemotron_vl(out: Path, seed: int) -> Path:
    return build_tiny_nemotron_vl_folder(out, seed=seed)


def _nemotron_qwen3_vision(out: Path, seed: int) -> Path:
    return build_tiny_nemotron_qwen3_vision_folder(out, seed=seed)


def _qwen_text(model_type: str) -> Callable[[Path, int], Path]:
    def build(out: Path, seed: int) -> Path:
        return build_tiny_qwen_text_folder(out, model_type=model_type, seed=seed)
    return build


SYNTHESIZERS: dict[str, Callable[[Path, int], Path]] = {
    "tiny_qwen2_5_vl": _qwen2_5_vl,
    "tiny_qwen3_vl": _qwen3_vl,
    "tiny_qwen3_vl_moe": _qwen3_vl_moe,
    "tiny_internvl": _internvl,
    "tiny_nemotron_vl": _nemotron_vl,
    "tiny_nemotron_qwen3_vision": _nemotron_qwen3_vision,
    "tiny_qwen2": _qwen_text("qwen2"),  # text-only (Qwen2.5-Math architecture)
    "tiny_qwen3": _qwen_text("qwen3"),
    "tiny_qwen3_moe": _qwen_text("qwen3_moe"),
}


MARKER = "synthesized.json"


def synthesize_model_folder(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny model `name` at `out_dir` (marker included) and return `out_dir`.

    Built under a name of this process's own, then renamed into place whole: demo configs share one folder, and two
    jobs started at once both build it; the first rename wins and the other job uses that folder (a folder of
    another tiny model is refused, naming model.synthesize). A crash leaves no half folder at `out_dir`."""
    if name not in SYNTHESIZERS:
        raise ValueError(f"model.synthesize: unknown tiny model {name!r}; known: {sorted(SYNTHESIZERS)}")
    out = Path(out_dir)
    staging = out.with_name(f".{out.name}.{os.getpid()}.building")
    try:
        folder = Path(SYNTHESIZERS[name](staging, seed))
        (folder / MARKER).write_text(json.dumps({"synthesize": name, "seed": seed}) + "\n")
        try:
            os.rename(folder, out)
        except OSError as e:
            if not (out / "config.json").is_file():  # a folder of other files, a file
                raise ConfigError(f"model.path: cannot build the tiny model {name!r} at {out} ({e.strerror or e}); "
                                  "model.synthesize builds only where nothing is: point model.path at a new "
                                  "folder") from None
            mismatch = synthesized_mismatch(name, out)  # another job built it first
            if mismatch is not None:
                raise ConfigError(f"model.synthesize: {mismatch}") from None
    finally:
        for leftover in (staging, staging.with_name(staging.name + ".tmp")):  # the builders stage in `<out>.tmp`
            shutil.rmtree(leftover, ignore_errors=True)
    return out


def synthesized_mismatch(name: Optional[str], folder: str | Path) -> Optional[str]:
    """Why `folder` is not the tiny model `name` asks for (it holds another one built here; the reason without the
    key, which the caller names: `model.synthesize`), or None."""
    marker = Path(folder) / MARKER
    if name is None or not marker.is_file():
        return None
    try:
        built = json.loads(marker.read_text()).get("synthesize")
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable marker says nothing about the folder: the folder is used as it is
    if built == name:
        return None
    return (f"{name!r} but model.path {folder} holds the tiny model {built!r} an earlier run built there; point "
            f"model.path at another folder (or remove that one)")
