"""The GPU suite without a GPU: its dry run lists every section and benchmark, the target rules read the
benchmarks' JSON correctly (synthetic rows with known answers), and the summary is written from
results on disk. The SFT-step benchmark runs end to end with --quick on the CPU and reports MFU."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_suite  # noqa: E402
from targets import TARGETS, Target, evaluate  # noqa: E402


def test_dry_run_lists_every_section_and_script(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for section in ("[env]", "[tests]", "[kernels]", "[e2e]", "[summary]"):
        assert section in proc.stdout
    scripts = re.findall(r"(benchmarks/(?:kernels|e2e)/bench_\w+\.py)", proc.stdout)
    assert len(set(scripts)) == len(gpu_suite.KERNEL_BENCHES) + 3  # every kernel benchmark and the three e2e ones
    for s in scripts:
        assert (REPO / s).is_file(), s
    assert "-m gpu" in proc.stdout and "tests/unit/kernels" in proc.stdout
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"


def test_unknown_section_is_refused():
    assert gpu_suite.main(["--dry-run", "--only", "kernel"]) == 2


def _rows(*rows):
    return {"rows": [dict(case=c, impl=i, ms=ms, note=note, frac_peak=fp) for c, i, ms, note, fp in rows]}


def test_ratio_rule_takes_the_worst_case():
    t = Target("t", "bench_x", "ratio", 0.9, case=r"fwd$", baseline="sdpa")
    data = _rows(("a fwd", "sdpa", 1.0, "", None), ("a fwd", "ours triton", 1.0, "", None),
                 ("b fwd", "sdpa", 1.0, "", None), ("b fwd", "ours triton", 2.0, "", None),
                 ("b bwd", "sdpa", 1.0, "", None), ("b bwd", "ours triton", 9.0, "", None))
    r = evaluate(t, data)
    assert r["cases"] == 2 and r["figure"] == pytest.approx(0.5) and r["met"] is False
    r = evaluate(Target("t", "bench_x", "ratio", 0.5, case=r"fwd$", baseline="sdpa"), data)
    assert r["met"] is True


def test_peak_time_and_memory_rules():
    data = _rows(("n fwd", "ours triton", 1.0, "", 0.9), ("m fwd", "ours triton", 1.0, "", 0.8))
    assert evaluate(Target("t", "b", "frac_peak", 0.85, case="fwd"), data)["met"] is False
    assert evaluate(Target("t", "b", "frac_peak", 0.85, case="^n"), data)["met"] is True
    mem = _rows(("N16k x fwd+bwd", "naive (full logits)", 10.0, "peak extra 4000 MiB", None),
                ("N16k x fwd+bwd", "ours triton", 11.0, "peak extra 800 MiB", None))
    r = evaluate(Target("t", "b", "memory_ratio_max", 0.25, case="^N16k", baseline="naive (full logits)"), mem)
    assert r["figure"] == pytest.approx(0.2) and r["met"] is True
    r = evaluate(Target("t", "b", "time_ratio_max", 1.2, case="^N16k", baseline="naive (full logits)"), mem)
    assert r["figure"] == pytest.approx(1.1) and r["met"] is True


def test_not_measured_is_said_not_guessed():
    t = Target("t", "bench_x", "ratio", 0.9, case="fwd", baseline="sdpa")
    assert evaluate(t, None)["met"] is None and evaluate(t, None)["why"] == "not run"
    only_base = evaluate(t, _rows(("a fwd", "sdpa", 1.0, "", None), ("a fwd", "ours triton", None, "OutOfMemory", None)))
    assert only_base["met"] is None and "no rows" in only_base["why"]
    e2e = Target("mfu", "bench_train_step", "min", 0.4, key="summary.mfu")
    assert evaluate(e2e, {"summary": {"mfu": 0.42}})["met"] is True
    assert evaluate(e2e, {"summary": {}})["met"] is None


def test_targets_name_implementations_the_scripts_produce():
    """A typo in an impl / baseline name would make a target silently "not measured" on the GPU."""
    for t in TARGETS:
        script = next(REPO.glob(f"benchmarks/*/{t.bench}.py"))
        re.compile(t.case)
        if t.key:
            continue
        literals = {n.value for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Constant)
                    and isinstance(n.value, str)}
        for name in (t.impl, t.baseline):
            if name:
                assert name in literals, f"{t.name}: {name!r} is not produced by {script.name}"


def test_summary_from_results_on_disk(tmp_path):
    run = tmp_path / "dev-2026-01-01"
    run.mkdir()
    (run / "bench_attention.json").write_text(json.dumps({"title": "attention", "rows": [
        dict(case="Qwen2.5-VL-7B LM causal 8k (28/4, D128) fwd", impl="sdpa default", ms=2.0, note="", frac_peak=0.5,
             vs_base=1.0),
        dict(case="Qwen2.5-VL-7B LM causal 8k (28/4, D128) fwd", impl="ours triton", ms=2.0, note="", frac_peak=0.5,
             vs_base=1.0)]}))
    (run / "bench_train_step.json").write_text(json.dumps({"summary": {"mfu": 0.31}}))
    text = gpu_suite.write_summary(run, {"kernels / bench_attention": 0}, tmp_path / "dev-2026-01-01")
    assert "| attention fwd, causal 8k D128 bf16 vs SDPA | bench_attention | ratio | 0.9 | 1 | yes |" in text
    assert "| SFT step MFU, Qwen2.5-VL-3B shape, 8k packed tokens | bench_train_step | min | 0.4 | 0.31 | **no** |" in text
    assert "not measured (not run)" in text
    saved = json.loads((tmp_path / "dev-2026-01-01.json").read_text())
    assert len(saved["targets"]) == len(TARGETS)


@pytest.mark.heavy
def test_train_step_benchmark_quick(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "e2e" / "bench_train_step.py"), "--quick", "--steps", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                               "HOME": str(tmp_path)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["tokens_per_s"] > 0 and summary["model_tflops_per_step"] > 0 and 0 < summary["mfu"] < 1.5


def test_e2e_figure_at_another_shape_is_not_judged():
    """A lease-sized rollout (128 new tokens) must not read as meeting or missing the 512-token target."""
    rollout = next(t for t in TARGETS if t.bench == "bench_rollout")
    at_target = {"meta": {"prompts": 4, "group": 8, "new_tokens": 512, "quick": False},
                 "results": {"ours_shared_prefix": {"vs_transformers": 3.5}}}
    assert evaluate(rollout, at_target)["met"] is True
    small = json.loads(json.dumps(at_target))
    small["meta"].update(prompts=2, new_tokens=128)
    r = evaluate(rollout, small)
    assert r["met"] is None and r["figure"] == pytest.approx(3.5)
    assert "new_tokens 128 (target: 512)" in r["why"] and "prompts 2 (target: 4)" in r["why"]


def test_rollout_target_reads_the_cuda_graph_row_when_there_is_one():
    """The engine's fastest configuration on CUDA (graph-replayed decode steps) is the figure; without that row the
    eager one; the summary says which row it read."""
    rollout = next(t for t in TARGETS if t.bench == "bench_rollout")
    data = {"meta": {"prompts": 4, "group": 8, "new_tokens": 512, "quick": False},
            "results": {"ours_shared_prefix": {"vs_transformers": 1.2}, "ours_cuda_graphs": {"vs_transformers": 3.4}}}
    r = evaluate(rollout, data)
    assert r["figure"] == pytest.approx(3.4) and r["met"] is True and "ours_cuda_graphs" in r["why"]
    del data["results"]["ours_cuda_graphs"]
    r = evaluate(rollout, data)
    assert r["figure"] == pytest.approx(1.2) and r["met"] is False and "ours_shared_prefix" in r["why"]
    assert "no results.ours_cuda_graphs" in evaluate(rollout, {"meta": {}, "results": {}})["why"]


def test_summary_says_not_comparable_for_a_smaller_shape(tmp_path):
    run = tmp_path / "dev"
    run.mkdir()
    (run / "bench_rollout.json").write_text(json.dumps({"meta": {"prompts": 2, "group": 8, "new_tokens": 128},
                                                        "results": {"ours_shared_prefix": {"vs_transformers": 0.5}}}))
    text = gpu_suite.write_summary(run, {}, tmp_path / "dev")
    row = next(line for line in text.splitlines() if line.startswith("| rollout tokens/s"))
    assert "not comparable (" in row and "measured at prompts 2" in row and "**no**" not in row


def test_kernel_benchmark_selection_and_partial_json(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))
    import common

    monkeypatch.setattr(sys, "argv", ["bench", "--quick", "--cases", "8k|ViT", "--no-compile",
                                      "--json", str(tmp_path / "t.json")])
    monkeypatch.setattr(common, "SELECTION", dict(common.SELECTION))
    common.parse_args("test")
    assert common.wanted("LM causal 8k fwd") and common.wanted("ViT windows", "eager")
    assert not common.wanted("packed 16k") and not common.wanted("LM causal 8k fwd", "torch.compile")
    table = common.Table("t", {"gbps": 1.0, "tflops": 1.0})
    assert "cases /8k|ViT/ only" in table.title and "no torch.compile rows" in table.title
    table.add("LM causal 8k fwd", "eager", 2.0)
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["partial"] is True and [r["ms"] for r in saved["rows"]] == [2.0]  # written before the run ends
    table.write_json(str(tmp_path / "t.json"))
    assert "partial" not in json.loads((tmp_path / "t.json").read_text())


def test_kernel_benchmark_selection_holds_for_scripts_that_do_not_ask(tmp_path, monkeypatch):
    """bench_moe / bench_linear_token_logprobs / bench_liger never call `wanted`: their rows outside --cases /
    --no-compile are still left out (and not timed), as the table's title says."""
    sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))
    import common

    monkeypatch.setattr(sys, "argv", ["bench", "--quick", "--cases", "down", "--no-compile"])
    monkeypatch.setattr(common, "SELECTION", dict(common.SELECTION))
    common.parse_args("test")
    table, timed = common.Table("t", {"gbps": 1.0, "tflops": 1.0}), []
    for case, impl in (("Qwen3 up fwd", "ours"), ("Qwen3 down fwd", "ours"), ("Qwen3 down fwd", "torch.compile")):
        common.try_bench(table, case, impl, lambda c=case, i=impl: timed.append((c, i)), "cpu", True)
    table.add("Qwen3 up unpermute", "reference", None, note="n/a")
    assert {r["case"] for r in table.rows} == {"Qwen3 down fwd"} and [r["impl"] for r in table.rows] == ["ours"]
    assert set(timed) == {("Qwen3 down fwd", "ours")}
    common.SELECTION["cases"] = re.compile("causal 8k$")  # asked by the script for the case, before " fwd" is added
    table.add("LM causal 8k fwd", "eager", 1.0)
    assert table.rows[-1]["case"] == "LM causal 8k fwd"


def test_unreadable_benchmark_json_is_reported_not_fatal(tmp_path):
    run = tmp_path / "dev"
    run.mkdir()
    (run / "bench_train_step.json").write_text('{"meta": {"tokens": 8192}, "summ')  # cut off mid-write
    text = gpu_suite.write_summary(run, {"benchmarks / bench_train_step": 124}, tmp_path / "dev")
    row = next(line for line in text.splitlines() if line.startswith("| SFT step MFU"))
    assert "not measured (unreadable bench_train_step.json" in row
    assert "unreadable JSON" in text
