"""MEGATRON_VLM_SEGV_BACKTRACE=1: a crash prints the native frames, then Python's faulthandler still prints the
Python frames and the process still dies of the signal (csrc/segv_backtrace.cpp). Run in a child process."""
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from megatron_vlm import _ext
assert _ext.load() is not None, _ext.unavailable_reason()
os.kill(os.getpid(), signal.SIGSEGV)
"""


def _crash(env_value):
    env = {**os.environ, "MEGATRON_VLM_SEGV_BACKTRACE": env_value}
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=120)


def test_native_frames_then_python_frames_then_the_signal(ext):
    proc = _crash("1")
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    native = proc.stderr.find("megatron_vlm._C: fatal signal SIGSEGV, native frames")
    python = proc.stderr.find("Fatal Python error: Segmentation fault")
    assert 0 <= native < python, proc.stderr[-2000:]
    assert "libc.so" in proc.stderr[native:python]  # the frames of kill()


def test_off_by_default(ext):
    proc = _crash("0")
    assert proc.returncode == -signal.SIGSEGV
    assert "native frames" not in proc.stderr and "Fatal Python error: Segmentation fault" in proc.stderr
