#!/usr/bin/env bash
# Install everything torpor needs into .venv at the checkout's root: the package with its dev tools,
# CPU PyTorch (for the demo, tests and benchmarks), a small sentence-transformers model with its weights
# (the model server of the warm-start tests and benchmark), PyYAML (the Kubernetes operator's kubeconfig)
# and CRIU >= 4.2 with torpor's rlimit shim (scripts/install-criu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null; then python=$(command -v "$candidate"); break; fi
    done
fi
[ -n "$python" ] || { echo "setup: no python3 found" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
echo "setup: installing torpor and its tools into .venv"
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[dev,torch,serve,kube]'
# the programs first: gcc builds install-criu.sh's rlimit shim
bash scripts/install-programs.sh
bash scripts/install-criu.sh .venv
bash scripts/install-slurm.sh
touch .venv/.setup-done
echo "setup: done; the CLI is .venv/bin/torpor"
