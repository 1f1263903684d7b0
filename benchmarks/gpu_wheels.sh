#!/usr/bin/env bash
# Download, HERE (a machine with the package index), the wheels the GPU machine lacks into .whl/ at the
# repository root, for `bash benchmarks/gpu_suite.sh --lease` to install there (it has no network).
# The list is benchmarks/gpu_wheels.txt (NAME==VERSION); wheels are for CPython 3.12 on manylinux x86_64,
# the GPU image's Python (BUILD_HERE: built here as pure-Python wheels). Idempotent: a wheel already present is kept, other versions of the same
# package are removed, so .whl/ holds exactly one version of each.
#   bash benchmarks/gpu_wheels.sh          # download what is missing, print the total size
#   bash benchmarks/gpu_wheels.sh --list   # print the NAME==VERSION list and exit
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=benchmarks/gpu_wheels.txt
DEST=${GPU_WHEELS_DIR:-.whl}  # the suite reads .whl (its --wheels); the variable is for tests
PY=${PYTHON:-$(command -v python3 || command -v python)}
specs=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
if [[ "${1:-}" == "--list" ]]; then
  echo "$specs"
  exit 0
fi
[[ $# -eq 0 ]] || { echo "gpu_wheels.sh: unknown argument $1 (only --list)" >&2; exit 2; }
mkdir -p "$DEST"
# packages whose PyPI release is sources that need a CUDA build; only their Python part is wanted there
BUILD_HERE="mamba-ssm"
# wheel file names spell the project name in lower case with runs of - _ . as one _ (PEP 427 / 503)
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }
failed=()
for spec in $specs; do
  name=${spec%%==*}
  version=${spec##*==}
  stem=$(norm "$name")
  shopt -s nullglob nocaseglob
  for f in "$DEST"/*.whl; do
    base=$(basename "$f")
    fstem=$(norm "${base%%-*}")
    fver=$(echo "$base" | cut -d- -f2)
    if [[ "$fstem" == "$stem" && "$fver" != "$version" ]]; then
      echo "removing $base (not $version)"
      rm -f -- "$f"
    fi
  done
  have=("$DEST"/"$stem"-"$version"-*.whl)
  shopt -u nullglob nocaseglob
  if [[ ${#have[@]} -gt 0 ]]; then
    echo "have $(basename "${have[0]}")"
    continue
  fi
  if [[ " $BUILD_HERE " == *" $name "* ]]; then
    # MAMBA_SKIP_CUDA_BUILD: a pure-Python wheel (the CUDA extension is not needed: megatron_vlm/testing/
    # mamba_ssm_triton.py); MAMBA_FORCE_BUILD: no attempt to download a prebuilt wheel from elsewhere
    if ! MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$PY" -m pip wheel -q --no-deps --no-build-isolation \
        -w "$DEST" "$spec"; then
      failed+=("$spec")
    fi
  elif ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$spec"; then
    failed+=("$spec")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "gpu_wheels.sh: could not download ${failed[*]} (no network or no package index? pip's message is above)" >&2
  exit 1
fi
echo "$DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in total"
