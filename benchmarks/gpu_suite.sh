#!/usr/bin/env bash
# Every GPU test and benchmark in one command; figures vs targets in benchmarks/gpu_results/.
# Options: --lease (the plan that fits one 15-minute GPU lease; run benchmarks/gpu_wheels.sh here first),
# --tar PATH (copy the results tarball there after every step), --dry-run (print the plan),
# --only <sections>, --force (re-run done sections and steps), --budget-min N.
# See benchmarks/gpu_suite.py (full plan) and benchmarks/gpu_lease.py (lease plan) for the steps and limits.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}  # the GPU image has python3 only
exec "$PY" benchmarks/gpu_suite.py "$@"
