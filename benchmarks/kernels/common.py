"""Shared pieces of the kernel benchmarks: timing, peak measurement, FLOP conventions, the table.

Method: on CUDA, `triton.testing.do_bench` (warm-up, L2 flush between runs,
median of CUDA-event timings); every table row is compared with a baseline timed in the same
run; throughput is reported against peaks measured in the same run — a large device-to-device
copy for bandwidth (bytes read + written / time) and a large bf16 matmul for compute.
`--quick` is a CPU smoke test (tiny shapes, wall-clock median of a few calls): it checks that
every script runs, not how fast anything is.
Short runs (a 15-minute GPU lease, gpu_suite.py --lease): `--cases REGEX` times only the cases whose
name matches and `--no-compile` leaves out the torch.compile baselines (their compilation takes most
of a short run); the table's title says so, and `Table.add` / `try_bench` leave out (untimed) every
row the selection excludes, in every script. With `--json`, the file is rewritten after every row
(marked "partial" until the end), so a benchmark ended by its time limit keeps the rows it finished.
FLOPs: attention forward = 4 * B * H * S_q * S_k * D (matmuls QK^T and PV), halved when causal
(S_q = S_k); backward = 2.5 x forward; varlen sums over the sequences.
"""
import argparse
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shapes, a few calls")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table here as JSON (rows with ratios)")
    parser.add_argument("--cases", default=None, metavar="REGEX", help="time only the cases whose name matches (re.search)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    SELECTION.update(cases=re.compile(args.cases) if args.cases else None, no_compile=args.no_compile, json=args.json)
    return args


SELECTION: dict = {"cases": None, "no_compile": False, "json": None}
"""What parse_args selected: the case regex, whether torch.compile rows are left out, the JSON path."""


def wanted(case: str, impl: str = "") -> bool:
    """Whether a case (and implementation) is to be timed under --cases / --no-compile."""
    if SELECTION["cases"] is not None and not SELECTION["cases"].search(case):
        return False
    return not (SELECTION["no_compile"] and impl.startswith("torch.compile"))


def row_wanted(case: str, impl: str = "") -> bool:
    """`wanted` for a table row: its case name or that name without its last word (" fwd" / " bwd": scripts that
    ask `wanted` themselves ask it for the case before adding that suffix, e.g. bench_attention with `--cases
    'causal 8k$'`)."""
    return wanted(case, impl) or wanted(case.rsplit(" ", 1)[0], impl)


def selection_note() -> str:
    """Suffix of a table title naming what --cases / --no-compile left out ("" when nothing)."""
    parts = []
    if SELECTION["cases"] is not None:
        parts.append(f"cases /{SELECTION['cases'].pattern}/ only")
    if SELECTION["no_compile"]:
        parts.append("no torch.compile rows")
    return f" [{'; '.join(parts)}]" if parts else ""


def do_bench(fn: Callable[[], object], device: str, quick: bool = False) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up (also compiles)
    times = []
    for _ in range(3 if quick else 10):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_peaks(device: str, quick: bool) -> dict:
    """{"gbps": copy bandwidth, "tflops": bf16 matmul} measured now on this device."""
    n_bytes = (8 if quick else 2048) * 2**20
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), device, quick)
    gbps = 2 * n_bytes / (ms * 1e-3) / 1e9
    n = 256 if quick else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = do_bench(lambda: a @ b, device, quick)
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    return {"gbps": gbps, "tflops": tflops}


def attention_flops(seqlens_q: list[int], seqlens_k: list[int], heads: int, head_dim: int, causal: bool, backward: bool = False) -> float:
    fwd = sum(4 * heads * sq * sk * head_dim * (0.5 if causal else 1.0) for sq, sk in zip(seqlens_q, seqlens_k))
    return fwd * (2.5 if backward else 1.0)


@dataclass
class Table:
    """Rows of one benchmark; the first row of each case is the baseline of its ratios."""

    title: str
    peaks: dict
    rows: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.title += selection_note()

    def add(self, case: str, impl: str, ms: Optional[float], *, flops: float = 0.0, bytes_moved: float = 0.0, note: str = "") -> None:
        if not row_wanted(case, impl):  # the title says only the selection is here, in every script
            return
        self.rows.append(dict(case=case, impl=impl, ms=ms, flops=flops, bytes=bytes_moved, note=note))
        print(f"[row] {case} | {impl} | " + (f"{ms:.4g} ms" if ms is not None else f"n/a {note}"), flush=True)
        if SELECTION["json"]:
            self.write_json(SELECTION["json"], partial=True)

    def computed_rows(self) -> list[dict]:
        """Rows with the derived figures: ratio to the case's baseline (first timed row), TFLOP/s,
        GB/s and the fraction of the peak measured in this run (None where not applicable)."""
        out, baseline = [], {}
        for r in self.rows:
            ms = r["ms"]
            row = {"case": r["case"], "impl": r["impl"], "ms": ms, "note": r["note"], "vs_base": None, "tflops": None,
                   "gbps": None, "frac_peak": None}
            if ms is not None:
                base = baseline.setdefault(r["case"], ms)
                row["vs_base"] = base / ms
                row["tflops"] = r["flops"] / (ms * 1e-3) / 1e12 if r["flops"] else None
                row["gbps"] = r["bytes"] / (ms * 1e-3) / 1e9 if r["bytes"] else None
                if row["tflops"]:
                    row["frac_peak"] = row["tflops"] / self.peaks["tflops"]
                elif row["gbps"]:
                    row["frac_peak"] = row["gbps"] / self.peaks["gbps"]
            out.append(row)
        return out

    def write_json(self, path: Optional[str], partial: bool = False) -> None:
        if path:
            data = {"title": self.title, "environment": environment(), "peaks": self.peaks, "rows": self.computed_rows()}
            if partial:
                data["partial"] = True
            tmp = f"{path}.partial"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)

    def print(self) -> None:
        print(f"\n## {self.title}")
        print(f"peaks measured now: copy {self.peaks['gbps']:.1f} GB/s, matmul {self.peaks['tflops']:.2f} TFLOP/s")
        header = f"{'case':<44} {'impl':<22} {'ms':>9} {'vs base':>8} {'TFLOP/s':>8} {'GB/s':>8} {'% peak':>7}  note"
        print(header)
        print("-" * len(header))
        baseline = {}
        for r in self.rows:
            ms = r["ms"]
            if ms is None:
                print(f"{r['case']:<44} {r['impl']:<22} {'n/a':>9} {'':>8} {'':>8} {'':>8} {'':>7}  {r['note']}")
                continue
            base = baseline.setdefault(r["case"], ms)
            tflops = r["flops"] / (ms * 1e-3) / 1e12 if r["flops"] else None
            gbps = r["bytes"] / (ms * 1e-3) / 1e9 if r["bytes"] else None
            frac = tflops / self.peaks["tflops"] if tflops else (gbps / self.peaks["gbps"] if gbps else None)
            print(
                f"{r['case']:<44} {r['impl']:<22} {ms:>9.3f} {base / ms:>7.2f}x "
                f"{(f'{tflops:.3g}' if tflops else ''):>8} {(f'{gbps:.3g}' if gbps else ''):>8} "
                f"{(f'{100 * frac:.0f}%' if frac else ''):>7}  {r['note']}"
            )


def try_bench(table: Table, case: str, impl: str, fn: Callable[[], object], device: str, quick: bool, **kw) -> None:
    """Time fn and add a row; a failing implementation becomes an 'n/a' row with the error. A case / implementation
    left out by --cases / --no-compile is not timed (scripts that do not ask `wanted` themselves skip it here)."""
    if not row_wanted(case, impl):
        return
    try:
        table.add(case, impl, do_bench(fn, device, quick), **kw)
    except Exception as exc:  # noqa: BLE001 - a benchmark row must not kill the others
        table.add(case, impl, None, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")


def peak_extra_memory_mb(fn: Callable[[], object], device: str) -> Optional[float]:
    """Peak memory allocated by fn() above what was allocated before it (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def ours_available(device: str) -> bool:
    """Our Triton kernels: compiled on CUDA; on the CPU only under the Triton interpreter
    (TRITON_INTERPRET=1, set by the CI smoke test so that our rows run too — their timings then
    mean nothing, the point is that the code path works)."""
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compile_fn(fn: Callable, quick: bool) -> Callable:
    """torch.compile baseline; in --quick the "eager" backend only checks the path (inductor's CPU
    codegen would take most of the smoke test's time)."""
    return torch.compile(fn, backend="eager") if quick else torch.compile(fn)


def liger(device: str):
    """liger_kernel.transformers (a baseline row), or None: not installed, or not on CUDA (Liger's norm,
    SwiGLU and rotary kernels do not run in Triton's CPU interpreter)."""
    if device != "cuda":
        return None
    try:
        import liger_kernel.transformers as lk  # noqa: F401
    except ImportError:
        return None
    return lk


def environment() -> str:
    import platform

    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)
