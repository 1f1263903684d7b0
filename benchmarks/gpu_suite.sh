#!/usr/bin/env bash
# Every GPU test and benchmark in one command; figures vs targets in benchmarks/gpu_results/.
# Options: --dry-run (print the plan), --only env,tests,kernels,e2e,summary, --force (re-run done sections).
# See benchmarks/gpu_suite.py for the sections and their time limits.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_suite.py "$@"
