#!/usr/bin/env bash
# Install a single-machine Slurm (slurmctld, slurmd, slurm-client) and munge from Debian's
# packages, for tests/integration/test_slurm*.py, which start their own daemons with a slurm.conf
# in a temporary folder.
#
# Idempotent and quick: it does nothing when the binaries are already there. Daemons are NOT
# started here (no systemd in CI containers): a temporary policy-rc.d stops the packages' init
# scripts from starting services during installation.
set -euo pipefail

need=()
for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
if [ "${#need[@]}" -eq 0 ]; then
    echo "install_slurm: slurm and munge already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    # 101 = "action not allowed": the packages' postinst scripts do not start their daemons.
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    made_policy=1
fi
cleanup() { if [ "$made_policy" -eq 1 ]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
if ! apt-cache policy slurmctld 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "install_slurm: installed $(slurmctld -V) and munge $(munged --version 2>&1 | head -1)"
