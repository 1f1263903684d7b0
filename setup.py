"""Install megatron-vlm, and build its compiled extension `megatron_vlm._C` (csrc/, CMakeLists.txt).

`kernels/` lives at the top level of the repository but is imported as `megatron_vlm.kernels`;
`package_dir` maps it there, for regular and editable installs. GPU/NPU-only packages are optional
extras: the base install and the test suite run on a CPU.

The extension is built by CMake against the torch installed in the target environment (found
through `torch.utils.cmake_prefix_path`, or on disk under site-packages when pip's build isolation
hides torch). CUDA sources are compiled only when torch is a CUDA build, a CUDA toolkit (nvcc) is
found and MEGATRON_VLM_NO_CUDA is unset. A failed build does not fail the install: the package
falls back to its pure-Python implementations (megatron_vlm/_ext.py warns once, naming why).
Environment:
  MEGATRON_VLM_NO_EXT=1       do not build the extension (and do not load it at run time)
  MEGATRON_VLM_NO_CUDA=1      build the CPU ops only
  MEGATRON_VLM_REBUILD=1      wipe the CMake build folder (build/ext-*) first
  MEGATRON_VLM_REQUIRE_EXT=1  make a failed build fail the install
  MEGATRON_VLM_BUILD_DIR=...  CMake build folder (default build/ext-<key> in the source tree, so
                              re-installs are incremental)
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_pkgs = [p for p in find_packages(include=["megatron_vlm", "megatron_vlm.*"])]
_kernel_pkgs = ["megatron_vlm.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no")


def _torch_info():
    """(cmake prefix path, torch is a CUDA build) of the torch the package will run with."""
    try:
        import torch  # noqa: F401  (present with --no-build-isolation)
        import torch.utils

        return torch.utils.cmake_prefix_path, torch.version.cuda is not None
    except ImportError:
        pass
    # Under build isolation torch is hidden from sys.path; the target environment's site-packages
    # are still where sysconfig says.
    for key in ("platlib", "purelib"):
        base = Path(sysconfig.get_paths()[key]) / "torch"
        if (base / "share" / "cmake" / "Torch" / "TorchConfig.cmake").is_file():
            version = (base / "version.py").read_text() if (base / "version.py").is_file() else ""
            cuda = re.search(r"^cuda\b[^=]*=\s*['\"]", version, re.M) is not None
            return str(base / "share" / "cmake"), cuda
    raise RuntimeError("torch is not installed in the target environment (install torch first)")


def _find_nvcc():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _tool(name: str):
    path = shutil.which(name)
    if path:
        return path
    try:  # the cmake / ninja wheels (build requirements) put their binaries here
        mod = __import__(name)
        attr = "CMAKE_BIN_DIR" if name == "cmake" else "BIN_DIR"
        cand = Path(getattr(mod, attr)) / name
        return str(cand) if cand.is_file() else None
    except (ImportError, AttributeError):
        return None


class CMakeBuild(build_ext):
    """Builds each extension by configuring and building CMakeLists.txt.

    An extension whose build failed is left out of what setuptools copies or lists afterwards
    (`build_ext --inplace`, `pip install -e .`): otherwise the install fails after the warning, on
    "can't copy ... _C...so: doesn't exist" (seen when torch is a CUDA build and the CUDA toolkit does not
    satisfy its CMake config)."""

    def build_extension(self, ext):
        try:
            self._cmake_build(ext)
        except Exception as err:  # noqa: BLE001 - the package must install without the extension
            if _flag("MEGATRON_VLM_REQUIRE_EXT"):
                raise
            self._failed = getattr(self, "_failed", set()) | {ext.name}
            why = (f"{Path(err.cmd[0]).name} {'configure' if '-S' in err.cmd else 'build'} step exited with "
                   f"{err.returncode}; its output is above" if isinstance(err, subprocess.CalledProcessError) else str(err))
            msg = f"megatron-vlm: building the compiled extension {ext.name} failed ({why}); " \
                  "the pure-Python implementations will be used (MEGATRON_VLM_REQUIRE_EXT=1 makes this fatal)"
            print("WARNING: " + msg, file=sys.stderr)

    def _without_failed(self, method, *args):
        every = self.extensions
        self.extensions = [e for e in every if e.name not in getattr(self, "_failed", set())]
        try:
            return method(*args)
        finally:
            self.extensions = every

    def copy_extensions_to_source(self):
        return self._without_failed(super().copy_extensions_to_source)

    def get_outputs(self):
        return self._without_failed(super().get_outputs)

    def get_output_mapping(self):
        return self._without_failed(super().get_output_mapping)

    def _cmake_build(self, ext):
        cmake = _tool("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found (pip install cmake, or install it with the system packages)")
        prefix, torch_cuda = _torch_info()
        nvcc = _find_nvcc()
        with_cuda = torch_cuda and nvcc is not None and not _flag("MEGATRON_VLM_NO_CUDA")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        key = hashlib.sha1(f"{sys.executable}|{prefix}|{with_cuda}".encode()).hexdigest()[:10]
        build_dir = Path(os.environ.get("MEGATRON_VLM_BUILD_DIR") or ROOT / "build" / f"ext-{key}")
        if _flag("MEGATRON_VLM_REBUILD") and build_dir.exists():
            shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={prefix}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMEGATRON_VLM_OUTPUT_DIR={out_dir}",
            f"-DMEGATRON_VLM_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DMEGATRON_VLM_TORCH_HAS_CUDA={'ON' if torch_cuda else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if with_cuda:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        ninja = _tool("ninja")
        cache = build_dir / "CMakeCache.txt"
        generator = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", cache.read_text(), re.M) if cache.exists() else None
        if ninja and (generator is None or generator.group(1) == "Ninja"):
            # the path is passed every time: under build isolation the ninja wheel moves between installs
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        print(f"megatron-vlm: building {ext.name} in {build_dir} (CUDA sources: {with_cuda})", file=sys.stderr)
        subprocess.run(args, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", str(os.cpu_count() or 2)], check=True)


setup(
    name="megatron-vlm",
    version="0.1.0",
    description="Megatron-style training of vision-language models: SFT and GRPO, GPU / NPU / CPU",
    python_requires=">=3.10",
    packages=_pkgs + _kernel_pkgs,
    package_dir={"megatron_vlm.kernels": "kernels"},
    # optional: setuptools does not insist on copying a file that a failed build did not produce
    ext_modules=[] if _flag("MEGATRON_VLM_NO_EXT") else [Extension("megatron_vlm._C", sources=[], optional=True)],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "tokenizers",
        "safetensors",
        "numpy",
        "pillow",
        "tomli-w",
        "tqdm",
        "tensorboard",
        "datasets",
        "sympy",
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "triton>=3.2", "math-verify", "ruff", "mypy>=1.11", "peft", "megatron-core==0.16.1",
                "trl==1.16.0",  # pure Python: the reference of the DPO / IPO / SimPO losses (tests/unit/training)
                "liger-kernel==0.8.5",  # pure Python + Triton: its kernels run in the CPU tests through the interpreter
                "setuptools", "wheel",  # what mamba-ssm's setup.py imports for scripts/setup_dev.sh's --no-build-isolation install
                "torchao==0.18.0"],  # the fp8 extra: its float8 training runs emulated in the CPU tests
        "gpu": ["flash-attn", "transformer-engine", "mamba-ssm", "causal-conv1d", "deep_ep", "liger-kernel"],
        "rollout": ["vllm"],
        "npu": ["torch_npu"],
        # megatron-core interop (megatron_vlm/models/mcore; tested with 0.16.1, the last line for Python 3.11)
        "mcore": ["megatron-core>=0.16.1"],
        "wandb": ["wandb"],
        # train.precision = "fp8": torchao's float8 linear layers (pure Python over torch._scaled_mm; 0.18.0 loads
        # its compiled extras only with torch >= 2.11 and works without them)
        "fp8": ["torchao==0.18.0"],
    },
)
