"""The GPU suite sized for one lease: 15 minutes of device time on one H100 / H200, from a bare machine.

Why a plan of its own: the full plan (gpu_suite.plan) runs its sections one after another and needs
~25 minutes; a lease gives 15 minutes in total, machine start included, and at most 10 minutes per
command. Facts about the GPU image this plan is built on (first lease, 2026-11-25): python3 3.12 with
torch 2.11+cu130, triton 3.6, transformers 5.17 (too old), pytest + xdist + timeout, nvcc 13; the
packages it lacks travel as wheels in `.whl/` (benchmarks/gpu_wheels.sh, list in gpu_wheels.txt) and
are installed into a --target folder put first on the children's PYTHONPATH; the repository is not
pip-installed, so `megatron_vlm.kernels` needs the symlink to ../kernels that setup.py's package_dir
otherwise provides.

Sections:
  setup       nvidia-smi, install the wheels, the kernels symlink, versions (one after another, ~30 s)
  tests       three correctness steps at once (~150 s): the extension build (~25-95 s alone) then its tests (2 xdist
              workers, so that a test crashing the interpreter loses one worker, not the step; native frames printed:
              MEGATRON_VLM_SEGV_BACKTRACE); the
              `gpu`-marked tests; the kernel tests on 6 xdist workers. The two test steps load no
              extension (MEGATRON_VLM_NO_EXT=1) so the build running beside them cannot race them. `heavy`
              tests are left out: they are CPU smoke tests (benchmarks under Triton's interpreter, a
              CPU-only rebuild of the extension) that CI runs, minutes of a lease for no GPU fact.
  benchmarks  one at a time (timings), most informative first (LEASE_BENCHES), each time-boxed and with
              lease-sized arguments: the shapes each measures are in its output JSON / title, and the
              summary marks an e2e figure taken at a smaller shape than its target's as such.
  summary     figures vs targets.

The step limits add up to at most 12 minutes (a CPU test checks it); the default --budget-min of the
lease, 9.5, keeps one command under the 10-minute cap: steps the budget cannot start are reported as
skipped and run in a second command, as is a step whose limit the budget cut and that ran into it (steps
that exited 0 are not re-run).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from gpu_steps import ROOT, Section, Step

WHEEL_LIST = ROOT / "benchmarks" / "gpu_wheels.txt"
LEASE_MINUTES = 12.0
"""What the step limits of the lease plan may add up to (wall clock, concurrent steps counted once)."""
LEASE_BUDGET_MIN = 9.5
"""Default --budget-min of --lease: under the 10-minute limit of one device command."""

# (script, time limit s, lease arguments, what the arguments mean for the figures); run in this order
LEASE_BENCHES = [
    ("kernels/bench_attention", 80, ["--cases", r"LM causal 8k|^packed|^ViT"],
     "target cases only: Qwen2.5-VL-7B causal 8k, packed 16k, ViT (no Nemotron 8k, no InternViT)"),
    ("e2e/bench_rollout", 110, ["--prompts", "2", "--group", "8", "--new-tokens", "128", "--repeats", "1",
                                "--runs", "ours_shared_prefix,transformers_generate", "--cuda-graphs"],
     "3B shape, 2 prompts x G 8 x 128 new tokens (target: 4 x 8 x 512), 1 round, eager and CUDA-graph decode steps, "
     "no no-sharing run"),
    ("e2e/bench_train_step", 35, ["--steps", "3"], "3B shape, 8k packed tokens (the target's), 3 timed steps"),
    ("e2e/bench_grpo_step", 60, ["--steps", "1", "--prompts", "2", "--group", "4", "--new-tokens", "64"],
     "3B shape, 2 prompts x G 4 x 64 new tokens (default: 8 x 8 x 512), 1 timed step"),
    ("kernels/bench_decode_attention", 20, [], "all cases (decides decode_attention's CUDA auto backend)"),
    ("kernels/bench_linear_token_logprobs", 30, [], "all cases"),
    ("kernels/bench_moe", 30, [], "all cases"),
    ("kernels/bench_rms_norm", 30, ["--no-compile"], "no torch.compile rows"),
    ("kernels/bench_swiglu", 20, ["--no-compile"], "no torch.compile rows"),
    ("kernels/bench_rotary", 20, ["--no-compile"], "no torch.compile rows"),
    ("kernels/bench_liger", 15, [], "all cases"),
]
LEASE_LEFT_OUT = {
    "bench_mamba_ssm": "mamba-ssm is not on the GPU image: every row would be n/a",
    "bench_transformer_engine": "Transformer Engine is not on the GPU image: every row would be n/a",
}


def wanted_wheels(path: Path = WHEEL_LIST) -> list[tuple[str, str]]:
    """(name, version) pairs of gpu_wheels.txt, in file order."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"{path}: {line!r} is not NAME==VERSION")
        out.append((name.strip(), version.strip()))
    return out


def _norm(name: str) -> str:
    """Project name as wheel file names spell it (PEP 427 / 503)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def resolve_wheels(wheel_dir: Path, wanted: list[tuple[str, str]]) -> tuple[list[Path], list[str]]:
    """(the wheel file of each wanted NAME==VERSION found in wheel_dir, the NAME==VERSION not found)."""
    files = sorted(Path(wheel_dir).glob("*.whl")) if Path(wheel_dir).is_dir() else []
    found, missing = [], []
    for name, version in wanted:
        hits = [f for f in files if _norm(f.name.split("-")[0]) == _norm(name) and f.name.split("-")[1] == version]
        if hits:
            found.append(hits[0])
        else:
            missing.append(f"{name}=={version}")
    return found, missing


def lease_plan(run_dir: Path, python: str, site: str, wheel_dir: Path) -> list[Section]:
    py = [python]
    wheels, _ = resolve_wheels(wheel_dir, wanted_wheels())
    # None = removed: Triton kernels are compiled on the GPU, not interpreted
    env = {"TRITON_INTERPRET": None, "PYTHONPATH": site if wheels else ""}
    no_ext = {**env, "MEGATRON_VLM_NO_EXT": "1"}
    setup = [Step("nvidia-smi", ["nvidia-smi"], 10)]
    if wheels:
        setup.append(Step("install wheels", py + ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                                  "--no-cache-dir", "--upgrade", "--target", site]
                          + [str(w.relative_to(ROOT)) if w.is_relative_to(ROOT) else str(w) for w in wheels], 35))
    setup += [
        Step("kernels symlink", ["bash", "-c", "test -e megatron_vlm/kernels || ln -sfn ../kernels megatron_vlm/kernels"], 5),
        Step("versions", py + ["benchmarks/gpu_env.py"], 30, env=env),
    ]
    pytest = py + ["-m", "pytest", "-q", "-rfEs", "-p", "no:randomly", "--continue-on-collection-errors", "--timeout", "150"]
    build = f"MEGATRON_VLM_REQUIRE_EXT=1 {shlex.quote(python)} setup.py build_ext --inplace"
    tests = [
        # native frames on a crash (two csrc tests crashed pytest on the first H100 lease: csrc/segv_backtrace.cpp)
        Step("extension build + csrc tests",
             ["bash", "-c", f"{build} && {shlex.join(pytest + ['-n', '2', '-m', 'not heavy'])} tests/unit/csrc"], 190,
             env={**env, "MEGATRON_VLM_SEGV_BACKTRACE": "1"}, group="correctness"),
        Step("gpu-marked tests",
             pytest + ["-m", "gpu and not heavy", "tests", "--ignore=tests/unit/kernels", "--ignore=tests/unit/csrc"],
             170, env=no_ext, group="correctness"),
        Step("kernel tests (compiled Triton, 6 workers)", pytest + ["-n", "6", "-m", "not heavy", "tests/unit/kernels"],
             170, env=no_ext, group="correctness"),
    ]
    benches = []
    for script, limit, args, note in LEASE_BENCHES:
        stem = script.split("/")[-1]
        benches.append(Step(stem, py + [f"benchmarks/{script}.py", *args, "--json", str(run_dir / f"{stem}.json")], limit,
                            json_out=f"{stem}.json", env=env, note=note))
    return [Section("setup", setup), Section("tests", tests), Section("benchmarks", benches), Section("summary", [])]
