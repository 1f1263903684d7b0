"""The e2e benchmarks the GPU suite runs refuse a count of 0 timed steps / rounds on the command line: it used to be
accepted and fail only at the end (a median of nothing), after the model build and the warm-up, minutes of a lease.
Each script's own parser reads the command line; nothing is built."""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[3] / "benchmarks" / "e2e"


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("script,flag", [("bench_rollout.py", "--repeats"), ("bench_train_step.py", "--steps"),
                                         ("bench_grpo_step.py", "--steps")])
def test_zero_timed_steps_are_refused_at_parse_time(script, flag, monkeypatch, capsys):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "path", [str(E2E), *sys.path])  # as `python benchmarks/e2e/<script>` has it
    monkeypatch.setattr(sys, "argv", [str(E2E / script), "--quick", flag, "0"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(E2E / script), run_name="__main__")
    assert e.value.code == 2 and flag in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [str(E2E / script), "--quick", flag, "1"])
    with pytest.raises(_Parsed):
        runpy.run_path(str(E2E / script), run_name="__main__")


def _run_without(package: str, script: Path, argv: list[str], monkeypatch, capsys) -> str:
    """Run `script` as __main__ with `argv` where `package` is not installed (no spec, its import fails); its stdout."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == package else real(name, *a, **k))
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("script,argv", [("bench_rollout.py", ["--vllm"]),
                                         ("bench_rollout.py", ["--engines", "ours,vllm", "--row", "a"]),
                                         ("profile_rollout_row.py", ["--row", "a"])])  # its default engines: ours,vllm
def test_vllm_rows_without_vllm_print_a_skip_line(script, argv, monkeypatch, capsys):
    """The vLLM rows where vllm does not import (the main environment): one `skipped:` line naming the environment
    to run them in, exit 0, nothing built; not a ConfigError / ModuleNotFoundError traceback after building the
    model folder."""
    out = _run_without("vllm", E2E / script, argv, monkeypatch, capsys)
    assert out.startswith("skipped: vLLM is not installed here") and "docs/vllm.md" in out, out


@pytest.mark.parametrize("script", ["bench_fp8.py", "fp8_loss_curve.py"])
def test_fp8_benchmarks_without_torchao_print_a_skip_line(script, monkeypatch, capsys):
    """torchao missing (the [fp8] extra not installed): one `skipped:` line naming the extra, exit 0, before a model
    is built; not a ConfigError traceback from the fp8 conversion."""
    out = _run_without("torchao", E2E / script, ["--quick"], monkeypatch, capsys)
    assert out.startswith("skipped: torchao is not installed") and "megatron-vlm[fp8]" in out, out


def test_math_reward_bench_without_math_verify_prints_a_skip_line(monkeypatch, capsys):
    """`--math-verify --skip-ours` where math-verify is not installed (it is only in the dev extra): one `skipped:`
    line naming the package, not an ImportError traceback."""
    out = _run_without("math_verify", E2E.parent / "math_reward_bench.py", ["--math-verify", "--skip-ours"],
                       monkeypatch, capsys)
    assert out.startswith("skipped: math-verify: not installed"), out


def test_paged_pool_benchmark_runs_both_engines_on_the_cpu(tmp_path):
    """bench_paged_pool.py at a toy size: both engines decode, the JSON holds their rates, rows per step and
    preemptions (a one-sequence budget against two paged slots), and the ratio."""
    import json
    import subprocess

    out = tmp_path / "paged.json"
    r = subprocess.run([sys.executable, str(E2E / "bench_paged_pool.py"), "--quick", "--prompts", "2", "--group", "2",
                        "--new-tokens", "40", "--full-seqs", "1", "--paged-slots", "4", "--block", "4", "--eos-frac",
                        "0.001", "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    engines = got["summary"]["engines"]
    assert set(engines) == {"slot_cache", "paged_on_demand"} and got["summary"]["ratio_median"] > 0
    assert engines["slot_cache"]["mean_rows_per_step"] == 1.0 and engines["slot_cache"]["preemptions"] == [0.0]
    assert engines["paged_on_demand"]["mean_rows_per_step"] > 1.0 and engines["paged_on_demand"]["preemptions"][0] > 0


def test_lockstep_refill_benchmark_runs_on_the_cpu(tmp_path):
    """bench_lockstep_refill.py --quick: both schedules decode; the refilled one takes fewer decode steps for the same
    prompts (each chunk of the baseline runs until its longest completion ends)."""
    import json
    import subprocess

    out = tmp_path / "refill.json"
    r = subprocess.run([sys.executable, str(E2E / "bench_lockstep_refill.py"), "--quick", "--prompts", "4", "--group", "2",
                        "--new-tokens", "30", "--eos-frac", "0.05", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads(out.read_text())["summary"]["runs"]
    assert runs["refilled"]["decode_steps"][0] < runs["chunked"]["decode_steps"][0]
    assert all(runs[k]["tokens"][0] > 0 for k in runs)


def test_paged_pool_rows_per_step_count_replayed_graph_steps(tmp_path, monkeypatch):
    """On a GPU the engines decode in CUDA graphs, whose replays run no Python: the rows per decode step must count
    those steps too. The benchmark's GPU form (graphs on) runs here twice, its static steps eager, then captured
    and replayed (tests/fixtures/fake_cuda_graphs.py): the same tokens and the same rows per step."""
    import json

    from megatron_vlm.inference.decode_graphs import DecodeStepRunner
    from megatron_vlm.models.common.slot_cache import SlotCache
    from tests.fixtures.fake_cuda_graphs import fake_cuda_graphs

    monkeypatch.syspath_prepend(str(E2E))
    import geometric_rollouts

    build = geometric_rollouts.build_setup

    def gpu_form(args):  # graphs on, as on a GPU; the device stays the CPU
        setup = build(args)
        setup.gpu = True
        return setup

    monkeypatch.setattr(geometric_rollouts, "build_setup", gpu_form)
    argv = ["--quick", "--prompts", "2", "--group", "2", "--new-tokens", "24", "--full-seqs", "2", "--paged-slots", "4",
            "--block", "2", "--eos-frac", "0.05", "--repeats", "1"]
    got = {}
    for name in ("eager", "replayed"):
        with monkeypatch.context() as m:
            m.setattr(DecodeStepRunner, "step", DecodeStepRunner.step)  # the script's spies: undone after the run
            m.setattr(SlotCache, "begin_step", SlotCache.begin_step)
            if name == "replayed":
                fake_cuda_graphs(m)
            m.setattr(sys, "argv", ["bench_paged_pool.py", *argv, "--json", str(tmp_path / f"{name}.json")])
            runpy.run_path(str(E2E / "bench_paged_pool.py"), run_name="__main__")
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())["summary"]["engines"]
    assert json.loads((tmp_path / "eager.json").read_text())["meta"]["cuda_graphs"] == "on"
    for engine in ("slot_cache", "paged_on_demand"):
        eager, replayed = got["eager"][engine], got["replayed"][engine]
        assert replayed["tokens"] == eager["tokens"]
        assert replayed["mean_rows_per_step"] == eager["mean_rows_per_step"] > 0, engine


def test_a_misspelt_decode_variant_is_refused_at_parse_time(monkeypatch, capsys):
    """profile_decode.py's --variants is checked by its argparse type, so the lease script's parse test
    (tests/unit/benchmarks/test_gpu_wave3.py) catches a misspelt variant in a lease command, not the lease."""
    script = E2E / "profile_decode.py"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # as the lease script's parse test stops it
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "path", [str(E2E), *sys.path])
    monkeypatch.setattr(sys, "argv", [str(script), "--variants", "triton:on,triton:on:fusd"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 2 and "triton:on:fusd" in capsys.readouterr().err
