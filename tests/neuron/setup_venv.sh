#!/usr/bin/env bash
# The NxD lane's own virtual environment (.venv-neuron), so that the main .venv keeps torch 2.13:
#   torch 2.9.0 + torch-xla 2.9.0 from PyPI (the CUDA build; it runs on the CPU), NeuronX Distributed 0.17 (Neuron SDK
#   2.28) from ../shared/vendor (its only source; installed, never copied), NxD's runtime dependencies, hlat itself,
#   and a .pth file that installs tests/neuron/neuron_stub.py (inert torch_neuronx / neuronxcc / libneuronxla) at
#   interpreter start. Every version is pinned in constraints-neuron.txt. An existing environment is reused when its
#   key (the pins, this script, pyproject.toml and the NxD tarball) is unchanged.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${NEURON_VENV:-.venv-neuron}"
TARBALL="${NXD_TARBALL:-../shared/vendor/neuronx-distributed-2.28.0.tar.gz}"
if [ ! -f "$TARBALL" ]; then
    echo "setup_venv.sh: NxD source $TARBALL not found (set NXD_TARBALL to the neuronx-distributed-2.28.0 tarball)" >&2
    exit 2
fi
key="$(cat constraints-neuron.txt pyproject.toml tests/neuron/setup_venv.sh "$TARBALL" | sha256sum | cut -c1-16)"
if [ -f "$VENV/.key" ] && [ "$(cat "$VENV/.key")" = "$key" ]; then
    echo "NxD lane: reusing $VENV (key $key)"
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q -c constraints-neuron.txt)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch torch-xla safetensors tenacity packaging setuptools boto3
# --no-deps: NxD's setup.py requires torch-neuronx, whose PyPI package is an empty placeholder.
"$VENV/bin/python" -m pip install -q --no-deps "$TARBALL"
"${PIP[@]}" -e . pytest
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import sys; sys.path.insert(0, '$PWD/tests/neuron'); import neuron_stub; neuron_stub.install()" \
    > "$site/hlat_neuron_stub.pth"
echo "$key" > "$VENV/.key"
echo "NxD lane: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
