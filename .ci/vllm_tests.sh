#!/usr/bin/env bash
# The vLLM back end's tests in their own environment (.ci/vllm_env.sh builds or reuses it; docs/vllm.md).
# That environment does not install this package: the tests import it from the checkout (PYTHONPATH), and
# `megatron_vlm.kernels`, which setup.py maps to kernels/, is reached through a link kept for the run.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY="$(bash .ci/vllm_env.sh | tail -n 1)"
unset PYTHONDONTWRITEBYTECODE  # the venv's modules compile to .pyc once (.ci/vllm_env.sh)
if [ ! -e megatron_vlm/kernels ]; then ln -s ../kernels megatron_vlm/kernels; trap 'rm -f megatron_vlm/kernels' EXIT; fi
# the tests that need torchvision (transformers' own video / image processors as the reference), which the main
# environment's CPU torch cannot load beside it: they skip there and run here
PYTHONPATH="$PWD" "$VLLM_PY" -m pytest -q -p no:cacheprovider -p no:randomly \
    tests/unit/checkpoint/test_export_pixel_limits.py::test_transformers_sizes_the_exported_videos_as_training_did \
    tests/unit/data/test_processor_nested_config.py::test_autoprocessor_counts_the_same_image_tokens
PYTHONPATH="$PWD" "$VLLM_PY" -m pytest -q -p no:cacheprovider -p no:randomly -m "vllm and not heavy" tests/unit/rl/test_vllm_engine.py \
    tests/unit/rl/test_vllm_families.py tests/unit/rl/test_vllm_multiturn.py tests/integration/test_grpo_vllm_job.py tests/integration/test_grpo_vllm_async.py \
    tests/integration/test_grpo_vllm_multiturn.py tests/unit/rl/test_vllm_routed_experts.py \
    tests/integration/parallel/test_vllm_ranks.py tests/integration/test_grpo_vllm_ranks.py "$@"
