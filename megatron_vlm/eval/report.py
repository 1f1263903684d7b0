"""The files an evaluation job writes into its run folder (rank 0):

- `eval_results.json`: the model, the settings (every config value that changes the result: eval/settings.py),
  and per benchmark its metrics (greedy accuracy,
  Avg@k, pass@k), how many rows it has (malformed lines included: each row is scored or a bad record) / were
  scored, which verifiers scored them, how many verifier
  calls timed out or failed (`verifier_failures`, each scored 0) and the bad
  records (skipped rows by file, row and category, each row once; `skipped_by_mode`: the rows the greedy /
  sampled pass could not score);
- `eval_results.md`: the same as a table (benchmark x metric, with the sample and bad-record
  counts) followed by the bad records of each benchmark — what a person reads;
- `eval_predictions/<benchmark>.jsonl`: every scored row (reference, completions, scores) for
  looking at what the model answered.

A run folder holds one run's results only: writing starts by removing a previous run's files (its
predictions of benchmarks this run leaves out would otherwise sit beside the new summary), writes the
predictions, then the table and the summary last, so an `eval_results.json` is there only when the
whole set is; a job killed before or while writing leaves none (`clear_eval_results`, called when an
evaluation starts, also keeps an earlier run's summary from passing for the killed one's). The benchmarks a stopped
job finished stay in `eval_partial/` for a job that runs again in the folder with the same settings (eval/resume.py);
writing the results removes that folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from megatron_vlm.durable import write_text_durably
from megatron_vlm.eval.resume import PARTIAL_DIR

__all__ = ["write_eval_results", "results_table", "clear_eval_results"]

_MAX_LISTED_BAD = 20


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def results_table(results: list[dict], settings: dict) -> str:
    """The markdown report (module docstring); metrics in percent."""
    k = settings.get("samples") or 0
    metric_cols = (["greedy"] if settings.get("greedy") else []) + ([f"avg@{k}", f"pass@{k}"] if k else [])
    head = ["benchmark", "rows", "scored", "bad records"] + [
        "greedy Avg@1" if m == "greedy" else m.replace("avg@", "Avg@") for m in metric_cols]
    lines = [f"# Evaluation of {settings.get('model')}", "",
             f"Accuracy in percent. Greedy = temperature 0, one completion; Avg@{k} / pass@{k} = {k} samples at "
             f"temperature {settings.get('temperature')}." if k else "Accuracy in percent (greedy: temperature 0).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        m = r["metrics"]
        cells = [r["name"], str(r["num_rows"]), str(m["num_scored"]), str(r["bad_records"]["num_bad_records"])]
        cells += [_fmt(m.get("greedy_accuracy" if c == "greedy" else c)) for c in metric_cols]
        lines.append("| " + " | ".join(cells) + " |")
    for r in results:  # scored 0, so they lower the accuracy: say how many
        fails = r.get("verifier_failures") or {}
        if any(fails.values()):
            unclosed = f", reasoning never closed {fails['reasoning_unclosed']}" if fails.get("reasoning_unclosed") else ""
            lines += ["", f"{r['name']}: verifier timeouts {fails.get('timeouts', 0)}, errors {fails.get('errors', 0)}"
                          f"{unclosed} (each scored 0)"]
    for r in results:
        bad = r["bad_records"]
        if not bad["num_bad_records"]:
            continue
        lines += ["", f"## Bad records of {r['name']} ({bad['num_bad_records']}: "
                      + ", ".join(f"{c} {n}" for c, n in bad["by_category"].items()) + ")", ""]
        for rec in bad["records"][:_MAX_LISTED_BAD]:
            lines.append(f"- {rec['source']}:{rec['index']} {rec['category']}: {rec['detail']}")
        if len(bad["records"]) > _MAX_LISTED_BAD:
            lines.append(f"- ... {len(bad['records']) - _MAX_LISTED_BAD} more in eval_results.json")
    return "\n".join(lines) + "\n"


def clear_eval_results(run_dir: str | os.PathLike) -> None:
    """Remove the result files of an earlier evaluation in `run_dir` (summary first: what marks them complete)."""
    run_dir = Path(run_dir)
    for name in ("eval_results.json", "eval_results.md"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "eval_predictions", ignore_errors=True)


def write_eval_results(run_dir: str | os.PathLike, results: list[dict], settings: dict) -> Path:
    """Write the three outputs (module docstring), the summary last; returns the path of eval_results.json."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_eval_results(run_dir)
    pred_dir = run_dir / "eval_predictions"
    pred_dir.mkdir(exist_ok=True)
    for r in results:
        write_text_durably(pred_dir / f"{r['name']}.jsonl", "".join(json.dumps(row, default=str) + "\n" for row in r["rows"]))
    summary = {"settings": settings,
               "benchmarks": {r["name"]: {k: v for k, v in r.items() if k not in ("rows", "name")} for r in results}}
    write_text_durably(run_dir / "eval_results.md", results_table(results, settings))
    path = run_dir / "eval_results.json"
    write_text_durably(path, json.dumps(summary, indent=2, default=str) + "\n")
    shutil.rmtree(run_dir / PARTIAL_DIR, ignore_errors=True)  # complete: nothing of it is kept for a later job
    return path
