"""The performance targets of the project, as data, and how a benchmark's JSON is checked against them.

Each target names the benchmark whose `--json` output holds the figure, which rows (case regex +
implementation) or summary key it reads, and the rule. The GPU suite (`gpu_suite.py`) turns them
into one table of "figure vs target"; nothing here is asserted in a test (timings are never test
conditions), the table only reports.

Kernel rules (rows of `benchmarks/kernels/common.Table.computed_rows()`):
- `ratio`: baseline ms / ours ms of the same case >= threshold (a speed-up, "0.9x SDPA");
- `frac_peak`: ours' GB/s (or TFLOP/s) / the peak measured in the same run >= threshold;
- `time_ratio_max`: ours ms / baseline ms <= threshold;
- `memory_ratio_max`: ours' peak extra MiB / the baseline's (from the rows' "peak extra N MiB"
  note) <= threshold.
Every matched case must meet the rule; the reported figure is the worst one.
End-to-end rules read `summary` / `results` keys of the e2e scripts' JSON (`min`: >= threshold).
An e2e target may name its shape (`shape`: dotted keys of the JSON and the values the target is stated
at, e.g. meta.new_tokens = 512): a figure measured at another shape (a GPU lease runs smaller ones) is
reported with met = None and why, never as meeting or missing the target; a JSON that does not record
a key is taken at its word.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Target", "TARGETS", "evaluate", "evaluate_all"]


@dataclass(frozen=True)
class Target:
    name: str
    bench: str
    """Benchmark id: the script's stem (bench_attention, ..., bench_train_step)."""
    rule: str
    threshold: float
    case: str = ""
    """Regex over the case names (kernel benchmarks)."""
    impl: str = "ours triton"
    baseline: str = ""
    key: str = ""
    """Dotted path into the e2e JSON (e.g. "summary.mfu")."""
    shape: tuple = ()
    """((dotted key, value the target is stated at), ...) checked before an e2e figure is judged."""


_NORM_CASES = r"(Qwen2\.5-VL-3B LM|Qwen2\.5-VL-7B LM|Nemotron-3-Nano|Qwen2\.5-VL ViT) .*(fwd|bwd)$"

TARGETS: list[Target] = [
    Target("attention fwd, causal 8k D128 bf16 vs SDPA", "bench_attention", "ratio", 0.9,
           case=r"LM causal 8k .* fwd$", baseline="sdpa default"),
    Target("attention bwd, causal 8k D128 bf16 vs SDPA", "bench_attention", "ratio", 0.8,
           case=r"LM causal 8k .* bwd$", baseline="sdpa default"),
    Target("packed varlen attention (8 samples, 16k) vs SDPA + block mask", "bench_attention", "ratio", 2.0,
           case=r"^packed 8 samples 16k .*(fwd|bwd)$", baseline="sdpa + mask"),
    Target("vision attention (D80, windows / full / sliding) vs SDPA + mask", "bench_attention", "ratio", 1.5,
           case=r"^ViT .*(fwd|bwd)$", baseline="sdpa + mask"),
    Target("rms_norm (+residual) share of copy bandwidth", "bench_rms_norm", "frac_peak", 0.85, case=_NORM_CASES),
    Target("rms_norm vs torch eager", "bench_rms_norm", "ratio", 2.0, case=_NORM_CASES, baseline="eager"),
    Target("apply_rotary share of copy bandwidth", "bench_rotary", "frac_peak", 0.85, case=r"16k|64k"),
    Target("swiglu share of copy bandwidth", "bench_swiglu", "frac_peak", 0.85, case=r"8k|32k|64k"),
    Target("linear_token_logprobs time vs naive full logits", "bench_linear_token_logprobs", "time_ratio_max", 1.2,
           case=r"^N16k", baseline="naive (full logits)"),
    Target("linear_token_logprobs peak extra memory vs naive", "bench_linear_token_logprobs", "memory_ratio_max", 0.25,
           case=r"^N16k", baseline="naive (full logits)"),
    Target("grouped GEMM (MoE up/down) vs torch._grouped_mm", "bench_moe", "ratio", 0.9,
           case=r"(up|down) .*(fwd|bwd)$", baseline="torch._grouped_mm"),
    Target("SFT step MFU, Qwen2.5-VL-3B shape, 8k packed tokens", "bench_train_step", "min", 0.40, key="summary.mfu",
           shape=(("meta.tokens", 8192), ("meta.quick", False))),
    Target("rollout tokens/s vs transformers generate (3B shape, G=8)", "bench_rollout", "min", 3.0,
           key="results.ours_cuda_graphs.vs_transformers|results.ours_shared_prefix.vs_transformers",
           shape=(("meta.prompts", 4), ("meta.group", 8), ("meta.new_tokens", 512), ("meta.quick", False))),
]

_PEAK_EXTRA = re.compile(r"peak extra ([0-9.]+) MiB")


def _dig(data: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _peak_extra(row: dict) -> Optional[float]:
    m = _PEAK_EXTRA.search(row.get("note") or "")
    return float(m.group(1)) if m else None


def evaluate(target: Target, data: Optional[dict]) -> dict:
    """{"figure": worst value or None, "met": True/False/None, "cases": n, "why": text when not measured}."""
    out = {"target": target.name, "bench": target.bench, "rule": target.rule, "threshold": target.threshold,
           "figure": None, "met": None, "cases": 0, "why": ""}
    if data is None:
        out["why"] = "not run"
        return out
    if target.key:
        keys = target.key.split("|")  # alternatives, first present: e.g. the CUDA-graph rollout row, else the eager one
        key = next((k for k in keys if isinstance(_dig(data, k), (int, float))), None)
        if key is None:
            out["why"] = f"no {' or '.join(keys)} in the output"
            return out
        value = _dig(data, key)
        out.update(figure=float(value), met=value >= target.threshold, cases=1)
        if len(keys) > 1:
            out["why"] = f"from {key}"
        off = [(k, _dig(data, k), want) for k, want in target.shape if _dig(data, k) is not None and _dig(data, k) != want]
        if off:
            out["met"] = None
            out["why"] = (out["why"] + "; " if out["why"] else "") + "measured at " + ", ".join(f"{k.split('.')[-1]} {got} (target: {want})" for k, got, want in off)
        return out
    rows = data.get("rows", [])
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        if re.search(target.case, r["case"]):
            by_case.setdefault(r["case"], {})[r["impl"]] = r
    figures = []
    for impls in by_case.values():
        ours = impls.get(target.impl)
        if ours is None or ours.get("ms") is None:
            continue
        base = impls.get(target.baseline) if target.baseline else None
        if target.rule == "frac_peak":
            value = ours.get("frac_peak")
        elif base is None or base.get("ms") is None:
            continue
        elif target.rule == "ratio":
            value = base["ms"] / ours["ms"]
        elif target.rule == "time_ratio_max":
            value = ours["ms"] / base["ms"]
        elif target.rule == "memory_ratio_max":
            mine, theirs = _peak_extra(ours), _peak_extra(base)
            value = mine / theirs if mine is not None and theirs else None
        else:
            raise ValueError(f"{target.name}: unknown rule {target.rule!r}")
        if value is not None:
            figures.append(value)
    if not figures:
        out["why"] = f"no rows for {target.impl!r}" + (f" and {target.baseline!r}" if target.baseline else "") + \
            f" matching /{target.case}/"
        return out
    lower_is_better = target.rule.endswith("_max")
    worst = max(figures) if lower_is_better else min(figures)
    met = worst <= target.threshold if lower_is_better else worst >= target.threshold
    out.update(figure=worst, met=met, cases=len(figures))
    return out


def evaluate_all(results_dir: Path) -> list[dict]:
    """Every target against `<results_dir>/<bench>.json` (missing file = not run; unreadable = said so)."""
    rows = []
    for t in TARGETS:
        path = Path(results_dir) / f"{t.bench}.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else None
        except ValueError as exc:  # a benchmark ended by its time limit while writing
            row = evaluate(t, None)
            row["why"] = f"unreadable {path.name}: {exc}"
            rows.append(row)
            continue
        rows.append(evaluate(t, data))
    return rows
