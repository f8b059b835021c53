#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, sbatch, scontrol…) and munge from the machine's own Debian
# repositories, for `torpor slurm` and its tests (tests/slurm). Skips the work when both are present.
#
# The packages' maintainer scripts may try to start the system's slurm and munge services; torpor's tests
# never use those: they start their own munged, slurmctld and slurmd on loopback with a private config.
set -euo pipefail

have_all() {
    local tool
    for tool in slurmctld slurmd sbatch scontrol squeue munged; do
        PATH=/usr/local/sbin:/usr/sbin:/sbin:$PATH command -v "$tool" >/dev/null || return 1
    done
}

# `sbatch --version` needs a slurm.conf; ask dpkg instead
version() { echo "slurm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo '(not from dpkg)')"; }

if have_all; then
    echo "slurm: $(version) and munge already installed"
    exit 0
fi

source "$(dirname "$0")/apt-install.sh"
debian_install slurm slurm-wlm munge
have_all || { echo "slurm: slurm-wlm installed but its tools are missing from PATH" >&2; exit 1; }
echo "slurm: installed $(version)"
