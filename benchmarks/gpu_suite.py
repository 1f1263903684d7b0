"""Run every GPU path of the project in one go and write the figures (driver behind gpu_suite.sh).

A GPU is a scarce, borrowed resource here: this script is what to run when one is available, so no
time goes into working out what to run. Sections, in order (each with its own time limit, the whole
suite sized to end within 25 minutes on one H100 / H200):

  env       device, driver, CUDA, torch, triton, transformers and optional backends
  tests     the `gpu`-marked tests and the kernel tests, Triton kernels compiled (not interpreted)
  kernels   every kernel benchmark with --json
  e2e       SFT step of the 3B shape (tokens/s, MFU), rollout vs transformers generate, GRPO step split
  summary   figures vs targets (benchmarks/targets.py) -> <out>.md + <out>.json

Resumable by section: each finished section leaves `<section>.done` in the run folder
(`benchmarks/gpu_results/<device>-<date>/`), and a re-run skips it unless `--force`; `--only a,b`
runs just those. `--dry-run` prints the plan (commands, limits, outputs) without running anything
and works without a GPU (tested in CI).

    bash benchmarks/gpu_suite.sh                 # everything
    bash benchmarks/gpu_suite.sh --dry-run       # what it would run
    bash benchmarks/gpu_suite.sh --only kernels,summary
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from targets import evaluate_all  # noqa: E402

KERNEL_BENCHES = ["bench_attention", "bench_rms_norm", "bench_rotary", "bench_swiglu", "bench_linear_token_logprobs", "bench_liger",
                  "bench_moe"]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    json_out: str = ""
    """File name (in the run folder) the step's --json output goes to."""
    env: dict = field(default_factory=dict)


@dataclass
class Section:
    name: str
    steps: list[Step]


def device_slug() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    except ImportError:
        pass
    return "no-gpu"


def plan(run_dir: Path, python: str = sys.executable) -> list[Section]:
    py = [python]
    env_free = {"TRITON_INTERPRET": None}  # None = removed: kernels are compiled on the GPU
    return [
        Section("env", [Step("nvidia-smi", ["nvidia-smi"], 30), Step("versions", py + ["benchmarks/gpu_env.py"], 60)]),
        Section("tests", [
            Step("gpu-marked tests", py + ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "tests"], 480, env=env_free),
            Step("kernel tests (compiled Triton)", py + ["-m", "pytest", "-q", "tests/unit/kernels"], 420, env=env_free),
        ]),
        Section("kernels", [
            Step(b, py + [f"benchmarks/kernels/{b}.py", "--json", str(run_dir / f"{b}.json")], 240, json_out=f"{b}.json",
                 env=env_free) for b in KERNEL_BENCHES
        ]),
        Section("e2e", [
            Step("bench_train_step", py + ["benchmarks/e2e/bench_train_step.py", "--json", str(run_dir / "bench_train_step.json")],
                 240, json_out="bench_train_step.json", env=env_free),
            Step("bench_rollout", py + ["benchmarks/e2e/bench_rollout.py", "--json", str(run_dir / "bench_rollout.json")],
                 300, json_out="bench_rollout.json", env=env_free),
            Step("bench_grpo_step", py + ["benchmarks/e2e/bench_grpo_step.py", "--json", str(run_dir / "bench_grpo_step.json")],
                 300, json_out="bench_grpo_step.json", env=env_free),
        ]),
        Section("summary", []),
    ]


def _child_env(extra: dict) -> dict:
    env = dict(os.environ)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env.setdefault("PYTHONPATH", str(ROOT))
    return env


def run_step(step: Step, log) -> int:
    log.write(f"\n$ {' '.join(step.argv)}\n")
    log.flush()
    t0 = time.time()
    try:
        proc = subprocess.run(step.argv, cwd=ROOT, env=_child_env(step.env), stdout=log, stderr=subprocess.STDOUT,
                              timeout=step.timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = 124
        log.write(f"\n[gpu_suite] {step.name}: time limit {step.timeout_s} s reached\n")
    except FileNotFoundError as exc:
        code = 127
        log.write(f"\n[gpu_suite] {step.name}: {exc}\n")
    log.write(f"[gpu_suite] {step.name}: exit {code} after {time.time() - t0:.0f} s\n")
    log.flush()
    return code


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}"


def write_summary(run_dir: Path, statuses: dict, out_stem: Path) -> str:
    rows = evaluate_all(run_dir)
    lines = [f"# GPU suite: {run_dir.name}", "", "| target | benchmark | rule | threshold | measured | met |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: "not measured" + (f" ({r['why']})" if r["why"] else "")}[r["met"]]
        lines.append(f"| {r['target']} | {r['bench']} | {r['rule']} | {r['threshold']} | {_fmt(r['figure'])} | {met} |")
    lines += ["", "| section / step | exit code |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in statuses.items()]
    versions = run_dir / "env.log"
    if versions.is_file():
        lines += ["", "Environment:", "", "```", versions.read_text()[-3000:].strip(), "```"]
    for b in sorted(run_dir.glob("bench_*.json")):
        data = json.loads(b.read_text())
        if "rows" in data:
            lines += ["", f"## {data.get('title', b.stem)}", "", "| case | impl | ms | vs base | % peak | note |",
                      "|---|---|---|---|---|---|"]
            for r in data["rows"]:
                frac = f"{100 * r['frac_peak']:.0f}%" if r.get("frac_peak") else ""
                lines.append(f"| {r['case']} | {r['impl']} | {_fmt(r['ms'])} | {_fmt(r['vs_base'])} | {frac} | {r['note']} |")
        else:
            lines += ["", f"## {b.stem}", "", "```", json.dumps(data, indent=1)[:3000], "```"]
    text = "\n".join(lines) + "\n"
    out_stem.with_suffix(".md").write_text(text)
    out_stem.with_suffix(".json").write_text(json.dumps({"targets": rows, "statuses": statuses}, indent=1))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run every GPU test and benchmark and write figures vs targets.")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--only", default="", help="comma-separated sections (env, tests, kernels, e2e, summary)")
    ap.add_argument("--force", action="store_true", help="re-run sections already marked done")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_results"), help="results folder")
    ap.add_argument("--tag", default=None, help="run name (default <device>-<date>)")
    ap.add_argument("--budget-min", type=float, default=25.0,
                    help="wall-clock budget: each step's limit is cut to what is left, later steps are skipped")
    args = ap.parse_args(argv)
    tag = args.tag or f"{device_slug()}-{time.strftime('%Y-%m-%d')}"
    run_dir = Path(args.out) / tag
    sections = plan(run_dir)
    known = [s.name for s in sections]
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in known]
    if unknown:
        print(f"--only: unknown section(s) {unknown}; known: {known}", file=sys.stderr)
        return 2
    chosen = [s for s in sections if not only or s.name in only]
    if args.dry_run:
        total = 0
        print(f"gpu_suite plan (dry run): results in {run_dir}, summary {run_dir}.md / .json")
        for s in chosen:
            done = (run_dir / f"{s.name}.done").is_file()
            print(f"[{s.name}]" + (" (done: skipped without --force)" if done and not args.force else ""))
            for st in s.steps:
                total += st.timeout_s
                env = " ".join(f"unset {k};" if v is None else f"{k}={v}" for k, v in st.env.items())
                print(f"  {st.name}: {env + ' ' if env else ''}{' '.join(st.argv)}  (limit {st.timeout_s} s)")
            if s.name == "summary":
                print("  figures vs targets (benchmarks/targets.py) -> markdown + json")
        print(f"sum of the step limits: {total / 60:.0f} min; the run stops starting steps after --budget-min "
              f"{args.budget_min:g} min (a step's limit is cut to what is left)")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    statuses_path = run_dir / "statuses.json"
    statuses = json.loads(statuses_path.read_text()) if statuses_path.is_file() else {}
    deadline = time.time() + 60 * args.budget_min
    for s in chosen:
        marker = run_dir / f"{s.name}.done"
        if s.name == "summary":
            continue
        if marker.is_file() and not args.force:
            print(f"[{s.name}] done earlier; skipped (use --force to re-run)")
            continue
        print(f"[{s.name}] running", flush=True)
        with open(run_dir / f"{s.name}.log", "w") as log:
            complete = True
            for st in s.steps:
                left = int(deadline - time.time())
                if left < 30:
                    statuses[f"{s.name} / {st.name}"] = "skipped: budget spent"
                    complete = False
                    continue
                st.timeout_s = min(st.timeout_s, left)
                code = run_step(st, log)
                statuses[f"{s.name} / {st.name}"] = code
                print(f"  {st.name}: exit {code}", flush=True)
                statuses_path.write_text(json.dumps(statuses, indent=1))
        if complete:
            marker.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    if not only or "summary" in only:
        text = write_summary(run_dir, statuses, run_dir.parent / tag)
        print(text.split("\n\n| section")[0])
        print(f"written: {run_dir.parent / tag}.md and .json")
    failed = {k: v for k, v in statuses.items() if v != 0}
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
