#!/usr/bin/env bash
# Install a one-node SLURM cluster's software (Debian's slurm-wlm + munge); run as root.
# CI runs this before the tests; .ci/slurm/up.sh then configures and starts it.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    echo "slurm-wlm and munge are already installed"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends slurm-wlm munge
