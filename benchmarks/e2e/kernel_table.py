"""Kernel tables from torch.profiler: device time by kernel and by category, without double counting.

Why a helper: `prof.key_averages()` mixes three kinds of rows that all carry "device time": the kernels
themselves, the CPU ops that launched them (`aten::mm`) and user annotations (`FSDP::pre_forward`,
`Optimizer.step#...`), so summing its rows counts a GEMM two or three times. Here only events that ran on
the device and are not annotations are kept (on the CPU: the ops' self CPU time, there are no kernels).
"""
from __future__ import annotations

import re

KERNEL_CATEGORIES = [  # first match wins; kernel names of cuBLAS / cuDNN / CUTLASS / Triton / ATen on Hopper
    ("attention", r"attn|attention|fmha|flash|sdpa"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|matmul|splitk"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norm / rotary / swiglu (ours)", r"rms|rotary|swiglu|layer_norm"),
    ("logprobs / loss", r"logprob|log_softmax|cross_entropy|logsumexp"),
    ("fp8 scaling (amax, casts)", r"amax|float8|fp8|e4m3|e5m2"),
    ("compiled fused (inductor)", r"^triton_(poi|red|per)_"),
    ("copies / casts", r"copy|cast|memcpy|memset|fill|chunk_cat|cat_"),
    ("sampling", r"scan|sort|topk|multinomial|exponential|argmax"),
    ("reductions", r"reduce|sum"),
]


def kernel_rows(prof, device_type: str) -> list[dict]:
    """[{name, calls, ms}] largest first: device kernels (CUDA) or CPU ops' self time (CPU)."""
    agg: dict[str, list] = {}
    for e in prof.events():
        if device_type == "cuda":
            if getattr(e, "is_user_annotation", False) or e.device_type.name != "CUDA":
                continue
            us = e.time_range.elapsed_us()  # a kernel event's own span on the device
        else:
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        row = agg.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += us / 1e3
    rows = [{"name": n[:120], "calls": c, "ms": ms} for n, (c, ms) in agg.items()]
    rows.sort(key=lambda r: -r["ms"])
    return rows


def categories(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rows:
        cat = next((c for c, pat in KERNEL_CATEGORIES if re.search(pat, r["name"], re.I)), "other")
        out[cat] = out.get(cat, 0.0) + r["ms"]
    return dict(sorted(out.items(), key=lambda x: -x[1]))
