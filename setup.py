"""Install megatron-vlm.

`kernels/` lives at the top level of the repository (DESIGN.md §2) but is imported as
`megatron_vlm.kernels`; `package_dir` maps it there, for regular and editable installs.
GPU/NPU-only packages are optional extras: the base install and the test suite run on a CPU.
"""
from setuptools import find_packages, setup

_pkgs = [p for p in find_packages(include=["megatron_vlm", "megatron_vlm.*"])]
_kernel_pkgs = ["megatron_vlm.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]

setup(
    name="megatron-vlm",
    version="0.1.0",
    description="Megatron-style training of vision-language models: SFT and GRPO, GPU / NPU / CPU",
    python_requires=">=3.10",
    packages=_pkgs + _kernel_pkgs,
    package_dir={"megatron_vlm.kernels": "kernels"},
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
        "dev": ["pytest", "pytest-timeout", "triton>=3.2", "math-verify"],
        "gpu": ["flash-attn", "transformer-engine", "mamba-ssm", "causal-conv1d", "deep_ep", "liger-kernel"],
        "rollout": ["vllm"],
        "npu": ["torch_npu"],
        "mcore": ["megatron-core"],
        "wandb": ["wandb"],
    },
)
