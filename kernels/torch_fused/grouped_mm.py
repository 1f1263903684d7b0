"""`grouped_mm` on `torch._grouped_mm` (cuBLAS / CUTLASS grouped GEMM; forward and backward in torch).

Why: on an H200 (torch 2.11, bf16, the Qwen3-VL-30B-A3B and Nemotron-3-Nano expert shapes of
benchmarks/kernels/bench_moe.py) it ran the expert matmuls 2.2-3.0x faster than our Triton kernel,
forward and backward (e.g. 0.81 vs 2.18 ms for 65536 x 2048 -> 1536 forward), at 65-73% of the
measured bf16 matmul peak against our 22-31%. So `auto` takes it on CUDA for bf16 on sm90+, the
configuration measured; elsewhere our Triton kernel / the reference stay (torch._grouped_mm has a
CPU implementation too, used by the tests, but no measurement says it beats the reference there).

Contract as kernels/reference/moe.py: groups from `tokens_per_expert` (counts) or `offsets`
(cumulative ends, torch._grouped_mm's own convention), both weight layouts, rows past the last group
come out as zeros (torch._grouped_mm leaves them unspecified), the same errors. torch._grouped_mm refuses
(RuntimeError "strides should be multiple of 16 bytes") a K or N whose rows are not a multiple of 16 bytes
(bf16: of 8 elements) and data not 16-byte aligned: the tiny test models' expert widths (4, 10, 12, 20) are
such, so those calls take the reference (per-expert matmuls; the shapes measured are all aligned).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference.moe import grouped_mm as reference_grouped_mm
from ..reference.moe import grouped_mm_group_ends


def available() -> Optional[str]:
    """None when torch has `_grouped_mm`, else why not."""
    return None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no torch._grouped_mm"


def cuda_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Registry check: the measured configuration (CUDA, bf16, compute capability 9.0 or newer)."""
    if (why := available()) is not None:
        return why
    if device_type != "cuda":
        return f"tensor on {device_type}; chosen only on cuda (the measured device)"
    if dtype != torch.bfloat16:
        return f"torch._grouped_mm is used for bfloat16 only, got {dtype}"
    if getattr(torch.version, "hip", None):  # ROCm reports its gfx version as the capability (MI300: 9.4)
        return f"ROCm (HIP {torch.version.hip}): measured on NVIDIA Hopper only"
    try:
        major, minor = torch.cuda.get_device_capability()
    except (RuntimeError, AssertionError) as exc:  # torch without CUDA / no device visible
        return f"no CUDA device to query ({exc})"
    if major < 9:
        return f"compute capability {major}.{minor}: torch._grouped_mm's fast path needs 9.0 (Hopper) or newer"
    return None


def aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: K and N rows of whole 16-byte units, 16-byte aligned data."""
    unit = 16 // x.element_size()
    return (x.shape[1] % unit == 0 and weight.shape[1] % unit == 0 and weight.shape[2] % unit == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tokens_per_expert: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    weight_layout: str = "ekn",
) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups in one grouped GEMM; differentiable."""
    ends = grouped_mm_group_ends(x, weight, tokens_per_expert, offsets, weight_layout)
    out_dim = weight.shape[2] if weight_layout == "ekn" else weight.shape[1]
    covered = ends[-1] if ends else 0
    if covered == 0:
        return x.new_zeros(x.shape[0], out_dim)  # as the reference: no group holds a row
    if not aligned(x, weight):  # torch._grouped_mm would refuse them (module docstring)
        return reference_grouped_mm(x, weight, tokens_per_expert=tokens_per_expert, offsets=offsets,
                                    weight_layout=weight_layout)
    offs = torch.tensor(ends, dtype=torch.int32, device=x.device)
    w_ekn = weight if weight_layout == "ekn" else weight.transpose(1, 2)
    rows = x if covered == x.shape[0] else x[:covered]
    out = torch._grouped_mm(rows, w_ekn, offs=offs)
    if covered < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - covered, out_dim)], dim=0)
    return out
