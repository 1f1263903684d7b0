"""The documented fallback of setup.py holds when the extension's CMake configure step fails (as on a machine
whose torch is a CUDA build and whose CUDA toolkit does not satisfy torch's CMake config: "Your installed
Caffe2 version uses CUDA but I cannot find the CUDA libraries"): the install succeeds without the extension,
with one warning, instead of failing afterwards on "can't copy ... _C...so: doesn't exist".

The failure is simulated with a `cmake` on PATH that fails the way torch's config does, on a copy of setup.py
with an empty package (so nothing of the real tree is built or overwritten); `build_ext --inplace` is what
`pip install -e .` runs. The heavy test does the editable install itself, in a throw-away venv."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_CAFFE2 = "Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries."


def _tree(tmp: Path) -> dict:
    shutil.copy(ROOT / "setup.py", tmp / "setup.py")
    for pkg in ("megatron_vlm", "kernels"):
        (tmp / pkg).mkdir()
        (tmp / pkg / "__init__.py").write_text("")
    fake = tmp / "fakebin"
    fake.mkdir()
    (fake / "cmake").write_text(f'#!/bin/sh\necho "CMake Error at TorchConfig.cmake: {_CAFFE2}" >&2\nexit 1\n')
    (fake / "cmake").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_VLM_")}
    return {**env, "PATH": f"{fake}{os.pathsep}{env.get('PATH', '')}", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _warnings(stderr: str) -> list[str]:
    return [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith("WARNING: megatron-vlm")]


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands for cmake")
def test_inplace_build_succeeds_without_the_extension_and_one_warning(tmp_path):
    env = _tree(tmp_path)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "can't copy" not in r.stderr
    (warning,) = _warnings(r.stderr)
    assert "cmake configure step exited with 1" in warning and "pure-Python implementations will be used" in warning
    assert not list((tmp_path / "megatron_vlm").glob("_C*"))
    # MEGATRON_VLM_REQUIRE_EXT=1 still makes it fatal
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                       env={**env, "MEGATRON_VLM_REQUIRE_EXT": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0


@pytest.mark.heavy
@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands for cmake")
def test_editable_install_succeeds_without_the_extension(tmp_path):
    (tmp_path / "src").mkdir()
    env = _tree(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    r = subprocess.run([*pip, "install", "-v", "--no-build-isolation", "--no-deps", "-e", str(tmp_path / "src")],
                       env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "can't copy" not in out and len(_warnings(out)) == 1, out[-4000:]
