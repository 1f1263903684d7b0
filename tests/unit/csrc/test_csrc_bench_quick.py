"""benchmarks/kernels/bench_csrc.py runs end to end with --quick (no timing asserted)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_csrc_quick(ext):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels" / "bench_csrc.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("position ids Qwen2.5-VL", "position ids Qwen3-VL", "first-fit packing", "gating", "moe_permute"):
        assert name in proc.stdout, proc.stdout[-3000:]


def test_bench_csrc_layer_ops_quick(ext):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels" / "bench_csrc_layer_ops.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("rms_norm fwd+bwd", "swiglu fwd+bwd", "apply_rotary fwd+bwd", "decode_attention"):
        assert name in proc.stdout, proc.stdout[-3000:]
