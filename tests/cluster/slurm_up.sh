#!/usr/bin/env bash
# Start the two-node Slurm cluster of the cluster lane in DIR (tests/cluster/slurm.py): python -m tests.cluster.slurm up DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m tests.cluster.slurm up "${1:?usage: $0 DIR}"
