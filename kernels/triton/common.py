"""Helpers shared by the Triton op modules: interpreter detection, launch sizes, dtype mapping."""
import os

import torch
import triton


def interpreted() -> bool:
    """True when kernels decorated now run in the Triton interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


INTERPRETED_AT_IMPORT = interpreted()


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Fail clearly when a kernel would be launched on a device it was not built for."""
    for t in tensors:
        if t.device.type == "cpu" and not INTERPRETED_AT_IMPORT:
            raise RuntimeError(
                f"triton {op}: tensor on cpu, but the Triton kernels were imported without TRITON_INTERPRET=1 "
                "(set it before importing megatron_vlm.kernels.triton modules)"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"triton {op}: tensor on {t.device.type}; triton kernels need cuda (or cpu interpreted)")


def direct_launch(*tensors) -> bool:
    """Whether a wrapper may launch its kernel directly instead of through its `torch.library.custom_op`: no
    autograd graph to record (grad mode off, or no input that requires grad) and no torch.compile trace. The
    custom op is what autograd and the compiler need; in plain inference its dispatch is only overhead, ~30 us of
    host time per call (measured on the CPU, 2026-11-26), while an eager decode step of a 36-layer model calls
    rms_norm / apply_rotary / swiglu ~150 times. Same kernel, same result either way."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def row_block(n: int) -> int:
    """Power-of-two block covering a row of n features (>= 16)."""
    return max(16, triton.next_power_of_2(n))


def num_warps_for(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


import triton.language as tl  # noqa: E402  (kept next to the jit helpers below)

# The Triton 3.9 interpreter converts fp32 -> bf16 by truncation (interpreter.py `_convert_float`
# without a rounding mode), while GPUs round to nearest even. Truncation biases sums of many
# rounded terms (e.g. P cast to bf16 before P^T dO), so interpreted kernels round explicitly.
_EMULATE_BF16_RTNE = tl.constexpr(INTERPRETED_AT_IMPORT)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr):
    """x.to(DTYPE) with round-to-nearest-even for bf16 also in the interpreter."""
    if _EMULATE_BF16_RTNE and DTYPE == tl.bfloat16:  # noqa: SIM300 -- DTYPE is a tl.constexpr argument, not a constant; keep the order the Triton frontend sees
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# The Triton 3.9 interpreter multiplies bf16 dot operands as their raw uint16 bits (interpreter.py
# create_dot); interpreted kernels upcast to fp32 first (exact: bf16 products fit in fp32).
_UPCAST_DOT = tl.constexpr(INTERPRETED_AT_IMPORT)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot with an fp32 accumulator; IEEE: full fp32 precision (no TF32) for fp32 operands."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
