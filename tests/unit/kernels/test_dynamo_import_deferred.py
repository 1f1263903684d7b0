"""torch._dynamo is imported by what compiles, not by the config package: a config refusal does without it.

The kernel registry marks its trace-time constants itself while dynamo is not imported (registry.py
`assume_constant_result`), and the MoE block wraps its eager expert region in torch.compiler.disable when the first
block is built (models/common/moe.py); either, done at import, imported torch._dynamo (~1.7 s) into every
`launch/pretrain_vlm.py` that only refused its config.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from megatron_vlm.kernels.registry import _marked_constant

REPO = Path(__file__).resolve().parents[3]


def test_the_registrys_mark_is_torchs_and_dynamo_takes_the_result_as_a_constant():
    def ours(x):
        calls.append(1)
        return 3

    def torchs(x):
        return 3

    calls: list = []
    assert vars(_marked_constant(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}

    def f(x):
        return x * ours(x)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.ones(2)
    assert torch.equal(compiled(x), x * 3) and torch.equal(compiled(x + 1), (x + 1) * 3)
    assert len(calls) == 1  # run once, while tracing: a constant of the graph, not a call in it


def test_a_config_refusal_runs_without_importing_dynamo():
    """A real launcher process (exit 2, the one line), asked at its exit whether torch._dynamo was imported."""
    probe = ("import atexit, runpy, sys; atexit.register(lambda: print('dynamo imported:', 'torch._dynamo' in "
             "sys.modules)); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", probe, str(REPO / "launch" / "pretrain_vlm.py"), "--config",
                        str(REPO / "launch" / "configs" / "demo_sft.toml"), "--check", "--set", "optimizer.lr=-1"],
                       capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert r.returncode == 2 and r.stderr.strip() == "config error: optimizer.lr: must be > 0, got -1.0", r.stderr
    assert r.stdout.strip() == "dynamo imported: False", r.stdout
