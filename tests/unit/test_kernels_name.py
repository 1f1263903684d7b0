"""The checkout's `kernels/` folder does not stand in for an installed `kernels` package (Hugging Face's).

transformers imports `kernels` when a distribution of that name is installed (at a version it supports), and the
launchers put the checkout's root first on `sys.path`: every model import then failed, importing names the op
library does not have. The installed package is stood in for by a folder on `PYTHONPATH` holding a `kernels`
package with the names transformers imports and its distribution metadata (no network: the real one is not
installed here).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_NAMES = ("CUDAProperties", "Device", "KernelizeFallback", "LayerRepository", "LocalLayerRepository", "Mode",
          "ROCMProperties", "register_kernel_mapping", "replace_kernel_forward_from_hub", "use_kernel_mapping",
          "get_kernel", "kernelize", "use_kernel_forward_from_hub", "use_kernelized_func")


def _installed_kernels(site: Path) -> None:
    from transformers.utils.import_utils import KERNELS_MIN_VERSION
    (site / "kernels").mkdir(parents=True)
    body = "".join(f"def {n}(*args, **kwargs):\n    return None\n" for n in _NAMES)
    (site / "kernels" / "__init__.py").write_text(f'__version__ = "{KERNELS_MIN_VERSION}"\n' + body)
    dist = site / f"kernels-{KERNELS_MIN_VERSION}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {KERNELS_MIN_VERSION}\n")


def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}  # the checkout first, as launchers do
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(site.parent), env=env,
                          timeout=300)


def test_transformers_imports_the_installed_kernels_package(tmp_path):
    site = tmp_path / "site"
    _installed_kernels(site)
    r = _run("import megatron_vlm, sys\nimport transformers.integrations.hub_kernels as h\n"
             "print(sys.modules['kernels'].__file__)\nprint(h.is_kernels_available())", site)
    assert r.returncode == 0, r.stderr[-3000:]
    path, available = r.stdout.split()[-2:]
    assert Path(path) == site / "kernels" / "__init__.py" and available == "True", r.stdout


def test_nothing_is_imported_without_an_installed_kernels_package(tmp_path):
    r = _run("import megatron_vlm, sys\nprint('kernels' in sys.modules)", tmp_path)
    assert r.returncode == 0 and r.stdout.split()[-1] == "False", (r.stdout, r.stderr[-2000:])
