""".ci/run's handling of the `megatron_vlm/kernels` link, run on a copy with fake tools (nothing is installed,
linted or tested): mypy needs the link (setup.py maps the package to kernels/, mypy finds packages by folder), so
the script makes it for mypy when it is missing and removes it afterwards; a link a developer made before must
be left in place (their `PYTHONPATH=$PWD` runs import megatron_vlm.kernels through it)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_checkout(tmp_path: Path, with_link: bool) -> tuple[Path, dict]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_dev.sh").write_text("exit 0\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "megatron_vlm").mkdir()
    if with_link:
        (tmp_path / "megatron_vlm" / "kernels").symlink_to("../kernels")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ruff", "python", "pip"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    # mypy records whether it saw the package folder
    (bin_dir / "mypy").write_text(f'#!/bin/sh\ntest -d megatron_vlm/kernels && echo seen > "{tmp_path}/mypy.txt"\n')
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MEGATRON_VLM_CI_VLLM": "0"}
    return tmp_path / ".ci" / "run", env


def test_a_link_made_before_is_kept(tmp_path):
    script, env = _fake_checkout(tmp_path, with_link=True)
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "mypy.txt").is_file()
    assert (tmp_path / "megatron_vlm" / "kernels").is_symlink()


def test_the_link_made_for_mypy_is_removed(tmp_path):
    script, env = _fake_checkout(tmp_path, with_link=False)
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "mypy.txt").is_file()  # mypy saw the package
    assert not os.path.lexists(tmp_path / "megatron_vlm" / "kernels")
