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

`--lease` runs the plan of gpu_lease.py instead: what fits one 15-minute GPU lease from a bare machine
(wheels installed from .whl/, correctness steps concurrently, lease-sized benchmarks by priority). The
full plan stays the default: it is the complete measurement, for a machine held longer, and the lease
plan is its cut-down, explicitly lease-sized subset (figures at smaller shapes are labelled as such).
Either way every finished step prints `name: exit N after S s`, and the run folder plus summary are
packed into `<out>/<tag>.tgz` after every step (gpu_pack.py; `--tar PATH` copies it there too, e.g.
$OUT/res.tgz), so a run cut short still returns what finished. A re-run skips finished sections and
steps that exited 0 (unless --force).

    bash benchmarks/gpu_wheels.sh                                  # here, before the lease
    bash benchmarks/gpu_suite.sh --lease --tar $OUT/res.tgz        # on the leased machine
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_lease import LEASE_BUDGET_MIN, LEASE_LEFT_OUT, lease_plan, resolve_wheels, wanted_wheels  # noqa: E402
from gpu_pack import pack  # noqa: E402
from gpu_steps import Section, Step, batch_limit_s, batches, end_all, run_batch, slug  # noqa: E402
from targets import evaluate_all  # noqa: E402

__all__ = ["KERNEL_BENCHES", "Section", "Step", "plan", "lease_plan", "write_summary", "main"]

KERNEL_BENCHES = ["bench_attention", "bench_rms_norm", "bench_rotary", "bench_swiglu", "bench_linear_token_logprobs", "bench_liger",
                  "bench_moe", "bench_decode_attention"]
KERNEL_BENCHES += ["bench_mamba_ssm", "bench_transformer_engine"]  # third-party backends' rows (decide `auto` priorities)


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


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}"


def write_summary(run_dir: Path, statuses: dict, out_stem: Path, steps: dict | None = None) -> str:
    """Figures vs targets, step exit codes (with seconds and lease arguments when `steps` gives them:
    {"section / step": {"seconds": s, "note": text}}), versions and every benchmark table -> out_stem.md / .json."""
    steps = steps or {}
    rows = evaluate_all(run_dir)
    lines = [f"# GPU suite: {run_dir.name}", "", "| target | benchmark | rule | threshold | measured | met |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["met"] is None:
            met = ("not comparable" if r["figure"] is not None else "not measured") + (f" ({r['why']})" if r["why"] else "")
        else:
            met = {True: "yes", False: "**no**"}[r["met"]] + (f" ({r['why']})" if r["why"] else "")
        lines.append(f"| {r['target']} | {r['bench']} | {r['rule']} | {r['threshold']} | {_fmt(r['figure'])} | {met} |")
    lines += ["", "| section / step | exit code | seconds | arguments / shapes |", "|---|---|---|---|"]
    for k, v in statuses.items():
        info = steps.get(k, {})
        secs = f"{info['seconds']:.0f}" if info.get("seconds") is not None else ""
        lines.append(f"| {k} | {v} | {secs} | {info.get('note', '')} |")
    for name in ("env.log", "setup.log"):
        versions = run_dir / name
        if versions.is_file():
            lines += ["", "Environment:", "", "```", versions.read_text()[-3000:].strip(), "```"]
            break
    for b in sorted(run_dir.glob("bench_*.json")):
        try:
            data = json.loads(b.read_text())
        except json.JSONDecodeError as exc:  # a benchmark killed while writing
            lines += ["", f"## {b.stem}", "", f"unreadable JSON: {exc}"]
            continue
        if "rows" in data:
            partial = " (partial: the benchmark did not finish)" if data.get("partial") else ""
            lines += ["", f"## {data.get('title', b.stem)}{partial}", "", "| case | impl | ms | vs base | % peak | note |",
                      "|---|---|---|---|---|---|"]
            for r in data["rows"]:
                frac = f"{100 * r['frac_peak']:.0f}%" if r.get("frac_peak") else ""
                lines.append(f"| {r['case']} | {r['impl']} | {_fmt(r['ms'])} | {_fmt(r['vs_base'])} | {frac} | {r['note']} |")
        else:
            lines += ["", f"## {b.stem}", "", "```", json.dumps(data, indent=1)[:3000], "```"]
    text = "\n".join(lines) + "\n"
    out_stem.with_suffix(".md").write_text(text)
    out_stem.with_suffix(".json").write_text(json.dumps({"targets": rows, "statuses": statuses, "steps": steps}, indent=1))
    return text


def _print_plan(sections: list[Section], run_dir: Path, args, wheel_dir: Path) -> None:
    print(f"gpu_suite plan (dry run{', lease' if args.lease else ''}): results in {run_dir}, summary {run_dir}.md / .json, "
          f"tarball {run_dir}.tgz" + (f" (copied to {args.tar})" if args.tar else ""))
    if args.lease:
        found, missing = resolve_wheels(wheel_dir, wanted_wheels())
        print(f"wheels from {wheel_dir}: {len(found)} of {len(found) + len(missing)} found, installed into {args.site} "
              "(first on the children's PYTHONPATH)"
              + (f"; missing {missing}: run bash benchmarks/gpu_wheels.sh" if missing else ""))
        for name, why in LEASE_LEFT_OUT.items():
            print(f"left out of the lease: {name} ({why})")
    total = 0
    for s in sections:
        done = (run_dir / f"{s.name}.done").is_file()
        print(f"[{s.name}]" + (" (done: skipped without --force)" if done and not args.force else ""))
        for b in batches(s.steps):
            if len(b) > 1:
                print(f"  concurrently ({b[0].group}, bound {max(st.timeout_s for st in b)} s):")
            for st in b:
                env = " ".join(f"unset {k};" if v is None else f"{k}={v}" for k, v in st.env.items() if v != "")
                indent = "    " if len(b) > 1 else "  "
                note = f"  [{st.note}]" if st.note else ""
                print(f"{indent}{st.name}: {env + ' ' if env else ''}{shlex.join(st.argv)}  (limit {st.timeout_s} s){note}")
        total += batch_limit_s(s.steps)
        if s.name == "summary":
            print("  figures vs targets (benchmarks/targets.py) -> markdown + json")
    print(f"wall-clock bound of the step limits: {total / 60:.1f} min (concurrent steps counted once); the run stops "
          f"starting steps after --budget-min {args.budget_min:g} min (a step's limit is cut to what is left)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run every GPU test and benchmark and write figures vs targets.")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--lease", action="store_true", help="the plan that fits one 15-minute GPU lease (gpu_lease.py)")
    ap.add_argument("--only", default="", help="comma-separated sections (full: env, tests, kernels, e2e, summary; "
                                                "lease: setup, tests, benchmarks, summary)")
    ap.add_argument("--force", action="store_true", help="re-run sections and steps already done")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_results"), help="results folder")
    ap.add_argument("--tag", default=None, help="run name (default <device>-<date>)")
    ap.add_argument("--tar", default=None, metavar="PATH", help="also copy the results tarball here after every step")
    ap.add_argument("--site", default="/tmp/site", help="--lease: folder the .whl/ wheels are installed into")
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="--lease: folder of the wheels (gpu_wheels.sh)")
    ap.add_argument("--budget-min", type=float, default=None,
                    help=f"wall-clock budget (default 25, --lease {LEASE_BUDGET_MIN:g}): each step's limit is cut to what "
                         "is left, later steps are skipped")
    args = ap.parse_args(argv)
    if args.budget_min is None:
        args.budget_min = LEASE_BUDGET_MIN if args.lease else 25.0
    tag = args.tag or f"{device_slug()}-{time.strftime('%Y-%m-%d')}"
    out = Path(args.out)
    run_dir = out / tag
    wheel_dir = Path(args.wheels)
    sections = lease_plan(run_dir, sys.executable, args.site, wheel_dir) if args.lease else plan(run_dir)
    known = [s.name for s in sections]
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in known]
    if unknown:
        print(f"--only: unknown section(s) {unknown}; known: {known}", file=sys.stderr)
        return 2
    chosen = [s for s in sections if not only or s.name in only]
    if args.dry_run:
        _print_plan(chosen, run_dir, args, wheel_dir)
        return 0
    if args.lease:
        _, missing = resolve_wheels(wheel_dir, wanted_wheels())
        if missing:
            print(f"[gpu_suite] wheels missing from {wheel_dir}: {missing} (run bash benchmarks/gpu_wheels.sh here and "
                  "carry .whl); the image's own packages are used for them", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    statuses_path = run_dir / "statuses.json"
    saved = json.loads(statuses_path.read_text()) if statuses_path.is_file() else {}
    statuses, step_info = saved.get("statuses", {}), saved.get("steps", {})
    if saved and "statuses" not in saved:  # the earlier format: {step: code}
        statuses = saved
    deadline = time.time() + 60 * args.budget_min
    tar_copy = Path(args.tar) if args.tar else None

    def record() -> None:
        """Statuses, summary and tarball as they stand: called after every step, so nothing here may end the run."""
        statuses_path.write_text(json.dumps({"statuses": statuses, "steps": step_info}, indent=1))
        try:
            write_summary(run_dir, statuses, out / tag, step_info)
        except Exception as exc:  # noqa: BLE001 - a bad benchmark output must not stop the remaining steps
            print(f"[gpu_suite] summary not written: {type(exc).__name__}: {exc}", flush=True)
        try:
            pack(out, tag, tar_copy)
        except OSError as exc:
            print(f"[gpu_suite] results not packed: {exc}", flush=True)

    def stop(signum, frame) -> None:
        """Stopped from outside (a lease's command limit, Ctrl-C): end the steps' process groups, pack what is there."""
        end_all()
        print(f"[gpu_suite] stopped by signal {signum}: running steps ended, results packed", flush=True)
        record()
        sys.exit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return _run_sections(chosen, only, args, run_dir, statuses, step_info, deadline, record)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_sections(chosen, only, args, run_dir, statuses, step_info, deadline, record) -> int:
    out, tag = run_dir.parent, run_dir.name
    for s in chosen:
        if s.name == "summary":
            continue
        marker = run_dir / f"{s.name}.done"
        if marker.is_file() and not args.force:
            print(f"[{s.name}] done earlier; skipped (use --force to re-run)", flush=True)
            continue
        print(f"[{s.name}] running", flush=True)
        complete = True
        for b in batches(s.steps):
            todo, cut = [], set()
            for st in b:
                key = f"{s.name} / {st.name}"
                if statuses.get(key) == 0 and not args.force:
                    print(f"  {st.name}: exit 0 earlier; skipped", flush=True)
                    continue
                left = int(deadline - time.time())
                if left < 30:
                    statuses[key] = "skipped: budget spent"
                    step_info[key] = {"seconds": None, "note": st.note}
                    print(f"  {st.name}: skipped (budget spent)", flush=True)
                    complete = False
                    continue
                if left < st.timeout_s:  # cut by the budget: a time-out then is the budget's, not the step's
                    st.timeout_s = left
                    cut.add(st.name)
                todo.append(st)
            if not todo:
                continue
            logs = {st.name: run_dir / (f"{s.name}.{slug(st.name)}.log" if len(todo) > 1 else f"{s.name}.log") for st in todo}

            def done(st: Step, code: int, secs: float, section: str = s.name) -> None:
                key = f"{section} / {st.name}"
                statuses[key] = code
                step_info[key] = {"seconds": round(secs, 1), "note": st.note}
                print(f"  {st.name}: exit {code} after {secs:.0f} s", flush=True)
                record()

            results = run_batch(todo, logs, done)
            for name in cut:
                if results.get(name, (0,))[0] == 124:  # the next command runs it again, with its own limit
                    print(f"  {name}: ended at its budget-cut limit; the section stays open", flush=True)
                    complete = False
        if complete:  # every step ran (failed ones too): a re-run goes on with the next section
            marker.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
        record()
    if not only or "summary" in only:
        record()
        text = (out / f"{tag}.md").read_text() if (out / f"{tag}.md").is_file() else ""
        print(text.split("\n\n| section")[0])
        print(f"written: {out / tag}.md, .json and {out / tag}.tgz" + (f" (copied to {args.tar})" if args.tar else ""))
    failed = {k: v for k, v in statuses.items() if v != 0}
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
