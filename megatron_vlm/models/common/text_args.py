"""What the families' decoder args share: reading the config.json fields they name alike, the checks every
GQA decoder makes, and the fields written back on export.

The Qwen2 / Qwen2.5-VL / Qwen3(-VL, -MoE) / InternVL LLM / Nemotron-H text configs spell these the same way;
each family's `args.py` reads and writes the rest (its rotary settings, MoE, vision) itself.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# config.json fields of every Qwen-style decoder, read and written under the same names
DECODER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps")


def given_fields(cfg: dict, names: Iterable[str]) -> dict[str, Any]:
    """The entries of `cfg` named in `names` that are present and not null (the dataclass defaults stand
    for the others)."""
    return {name: cfg[name] for name in names if cfg.get(name) is not None}


def decoder_hf_fields(args: Any) -> dict[str, Any]:
    """`DECODER_FIELDS` of `args` as config.json entries."""
    return {name: getattr(args, name) for name in DECODER_FIELDS}


def check_gqa(args: Any, section: str = "text_config") -> None:
    """ValueError naming the key unless the query heads are a whole multiple of the key / value heads."""
    if args.num_attention_heads % args.num_key_value_heads:
        raise ValueError(
            f"{section}: num_attention_heads {args.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {args.num_key_value_heads}"
        )


def check_swiglu_decoder(args: Any, section: str = "text_config") -> None:
    """The checks of a SwiGLU GQA decoder: a SiLU-gated MLP and whole groups of query heads."""
    if args.hidden_act != "silu":
        raise ValueError(f"{section}.hidden_act: only 'silu' is supported, got {args.hidden_act!r}")
    check_gqa(args, section)
