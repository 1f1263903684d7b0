"""FP8 training (`train.precision = "fp8"`): the language decoder's linear layers become torchao `Float8Linear`s.

Why only those: they hold almost all of a VLM step's matmul FLOPs, while the vision tower (few tokens, a
different activation range per image), the multimodal projector and the lm_head (logits feed the loss
directly; float8 error there is error in every token's log-prob) are where low precision is least safe, so
they stay bf16 like the rest of the job (norms, attention, the optimizer's fp32 master weights).

Each converted layer casts its input, weight and output gradient to float8 with dynamic scales computed
from the current tensors (torchao's "tensorwise" recipe: one scale per tensor; "rowwise": one per row,
powers of two) and runs the three matmuls of forward and backward through `torch._scaled_mm`; the weight
parameter itself stays a plain high-precision tensor, so optimizer state, checkpoints and the Hugging Face
export are exactly those of a bf16 run. Layers whose sizes are not multiples of 16 (what `_scaled_mm`
needs) stay bf16; the token dimension, which packing makes arbitrary, is zero-padded by torchao
(`pad_inner_dim`).

On the CPU the same layers run in torchao's emulation mode (float8 casts, matmuls of the dequantized
values): the numerics of fp8 training without its speed, which is what the tests check. A CUDA device
below compute capability 8.9 (pre-Ada) has no float8 matmul and is refused, as is any other device.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal, Optional

import torch
from torch import nn

from megatron_vlm.errors import ConfigError

__all__ = ["FP8_MIN_CAPABILITY", "convert_to_fp8", "fp8_emulated", "fp8_module_filter", "fp8_linear_config"]

log = logging.getLogger("megatron_vlm")

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada sm89, Hopper sm90 and later)."""

DECODER_PREFIX = "language_model."
"""Where the converted layers live in every family model (the vision tower, projector and lm_head are outside)."""


def fp8_emulated(device: torch.device) -> bool:
    """True on the CPU (torchao's emulation, said once in the log); False on a CUDA GPU with float8 matmuls;
    ConfigError (exit 2) anywhere else."""
    if device.type == "cpu":
        log.warning("train.precision = \"fp8\" on the CPU: torchao's float8 emulation (float8 casts, matmuls of the "
                    "dequantized values): the numerics of fp8 training, not its speed")
        return True
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            raise ConfigError(f"train.precision: \"fp8\" needs a GPU of compute capability >= "
                              f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (Ada, Hopper or later); "
                              f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: use \"bf16\"")
        return False
    raise ConfigError(f"train.precision: \"fp8\" runs on CUDA GPUs (or emulated on the CPU), not on {device.type}: use \"bf16\"")


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Whether the module at `fqn` (relative to the family model) becomes a Float8Linear: a torch Linear of the
    language decoder whose both sizes are multiples of 16."""
    if not isinstance(module, nn.Linear) or not fqn.startswith(DECODER_PREFIX):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _import_torchao():
    """torchao's float8 training API. Its import logs a warning for each compiled extension it cannot load
    (all of them on a CPU build of torch), and torch a deprecation notice about one of its enums; float8
    training is Python over `torch._scaled_mm` and needs none of them, so both are silenced."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(f"train.precision: \"fp8\" needs torchao (pip install 'megatron-vlm[fp8]'): {e}") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training


def fp8_linear_config(recipe: Literal["tensorwise", "rowwise"], emulate: bool):
    """torchao's `Float8LinearConfig` for `recipe`, emulated or not, padding the inner dimension to 16."""
    Float8LinearConfig, _ = _import_torchao()
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, pad_inner_dim=True)


def convert_to_fp8(model: nn.Module, recipe: Optional[str], device: torch.device) -> int:
    """Swap the language decoder's eligible Linear layers of `model` (before FSDP2 sharding) for Float8Linear
    with `recipe` (None = tensorwise); returns how many. ConfigError (exit 2) when the device cannot run
    fp8, torchao is missing, or no layer qualifies (the run would silently be bf16)."""
    if recipe not in (None, "tensorwise", "rowwise"):
        raise ConfigError(f"train.fp8_recipe: {recipe!r}; expected 'tensorwise' or 'rowwise'")
    emulate = fp8_emulated(device)
    config = fp8_linear_config("rowwise" if recipe == "rowwise" else "tensorwise", emulate)
    _, convert_to_float8_training = _import_torchao()
    names = [n for n, m in model.named_modules() if fp8_module_filter(m, n)]
    if not names:
        raise ConfigError("train.precision: \"fp8\" found no language-decoder Linear layer whose sizes are multiples "
                          "of 16 to convert")
    convert_to_float8_training(model, module_filter_fn=fp8_module_filter, config=config)
    converted = set(names)
    kept = sum(1 for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in converted)
    log.info("train.precision = fp8 (%s scaling%s): %d language-decoder Linear layers run float8 matmuls; %d other "
             "Linear layers (vision tower, projector, lm_head, sizes not multiples of 16) stay bf16",
             recipe or "tensorwise", ", emulated" if emulate else "", len(names), kept)
    return len(names)
