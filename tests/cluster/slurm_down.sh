#!/usr/bin/env bash
# Stop the two-node Slurm cluster of the cluster lane in DIR (tests/cluster/slurm.py): python -m tests.cluster.slurm down DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m tests.cluster.slurm down "${1:?usage: $0 DIR}"
