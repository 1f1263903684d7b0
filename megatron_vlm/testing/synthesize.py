"""`[model] synthesize = "<name>"`: the tiny, deterministic, offline model folders the demos and
tests train (config + random weights + tokenizer + processor files, in the real HF layout)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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


def synthesize_model_folder(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    if name not in SYNTHESIZERS:
        raise ValueError(f"model.synthesize: unknown tiny model {name!r}; known: {sorted(SYNTHESIZERS)}")
    return SYNTHESIZERS[name](Path(out_dir), seed)
