#!/usr/bin/env bash
# Developer set-up, the one install command of the README and of CI (.ci/run): torch, the package with its test
# tools, and mamba-ssm's Python part. Safe to run again (pip leaves what is installed).
#
#   bash scripts/setup_dev.sh                          # torch 2.13 (CPU build where the pip index serves it)
#   MEGATRON_VLM_KEEP_TORCH=1 bash scripts/setup_dev.sh  # keep the torch already installed (GPU / NPU builds)
#   MEGATRON_VLM_TORCH="torch==2.13.0+cu128" bash scripts/setup_dev.sh  # another torch requirement
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# 1. torch first (a CPU build from the local wheel index on CI), so the install below does not pull a CUDA build
if [ "${MEGATRON_VLM_KEEP_TORCH:-0}" != "1" ]; then
    pip install -q "${MEGATRON_VLM_TORCH:-torch==2.13.0}"
fi
# 2. the package (builds megatron_vlm._C from csrc/ against that torch) and the test / lint / type-check tools
pip install -q -e ".[dev]"
# 3. mamba-ssm's Python part, for the tests that run its Mamba-2 Triton kernels in Triton's interpreter against
#    our adapter: no CUDA build (on a GPU machine install mamba-ssm the usual way instead); --no-build-isolation:
#    its setup.py imports the torch installed above, and setuptools / wheel from the dev extra
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install -q --no-deps --no-build-isolation mamba-ssm==2.3.2.post1 einops
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('mamba_ssm') is None)" \
    || { echo "setup_dev.sh: mamba_ssm did not install" >&2; exit 1; }
echo "setup_dev.sh: done; the demo: torchrun --nproc_per_node 2 launch/pretrain_vlm.py --config launch/configs/demo_sft.toml"
