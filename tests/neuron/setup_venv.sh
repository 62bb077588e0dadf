#!/usr/bin/env bash
# The NxD lane's own virtual environment (.venv-neuron), so that the main .venv keeps torch 2.13:
#   torch 2.9.0 + torch-xla 2.9.0 from PyPI (the CUDA build; it runs on the CPU), NeuronX Distributed 0.17 (Neuron SDK
#   2.28), NxD's runtime dependencies, hlat itself, and a .pth file that installs tests/neuron/neuron_stub.py (inert
#   torch_neuronx / neuronxcc / libneuronxla) at interpreter start. Every version is pinned in constraints-neuron.txt
#   (NxD's in NXD_VERSION below). An existing environment is reused when its key (the pins, this script,
#   pyproject.toml and the NxD source) is unchanged.
# NxD comes from the Neuron pip repository (PyPI's neuronx-distributed is an empty placeholder), downloaded before
# anything else is installed, so an unreachable repository fails in seconds. NXD_SOURCE=<file> (NXD_TARBALL, its old
# name, works too) installs a local copy of the same release instead: its wheel or sdist, or the source archive of
# github.com/aws-neuron/neuronx-distributed at tag v2.28.0, for machines without access to the Neuron repository.
# NXD_INDEX replaces the repository's URL (a mirror of it). --print-source prints what NxD would be installed from,
# and exits without building anything.
set -euo pipefail
NXD_SOURCE="${NXD_SOURCE:-${NXD_TARBALL:-}}"
if [ -f "$NXD_SOURCE" ]; then  # relative to where the script was called from
    NXD_SOURCE="$(cd "$(dirname "$NXD_SOURCE")" && pwd)/$(basename "$NXD_SOURCE")"
fi
cd "$(dirname "$0")/../.."
VENV="${NEURON_VENV:-.venv-neuron}"
NXD_VERSION=0.17.26814   # neuronx-distributed in Neuron SDK 2.28 (the SDK's package list)
NXD_INDEX="${NXD_INDEX:-https://pip.repos.neuron.amazonaws.com}"
NXD_REQ="neuronx-distributed==$NXD_VERSION"
LOCAL_COPY="NxD 0.17's wheel or sdist, or the source archive of github.com/aws-neuron/neuronx-distributed tag v2.28.0"

if [ -n "$NXD_SOURCE" ] && [ ! -f "$NXD_SOURCE" ]; then
    echo "setup_venv.sh: NXD_SOURCE=$NXD_SOURCE not found: point it at $LOCAL_COPY, or unset it to install" \
        "$NXD_REQ from the Neuron pip repository ($NXD_INDEX)" >&2
    exit 2
fi
if [ "${1:-}" = "--print-source" ]; then
    if [ -n "$NXD_SOURCE" ]; then echo "$NXD_SOURCE"; else echo "$NXD_REQ --extra-index-url $NXD_INDEX"; fi
    exit 0
fi
if [ -n "$NXD_SOURCE" ]; then nxd_key="$(sha256sum < "$NXD_SOURCE")"; else nxd_key="$NXD_REQ $NXD_INDEX"; fi
key="$(cat constraints-neuron.txt pyproject.toml tests/neuron/setup_venv.sh <(echo "$nxd_key") | sha256sum | cut -c1-16)"
if [ -f "$VENV/.key" ] && [ "$(cat "$VENV/.key")" = "$key" ]; then
    echo "NxD lane: reusing $VENV (key $key)"
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
nxd="$NXD_SOURCE"
if [ -z "$nxd" ]; then
    # --extra-index-url: PyPI still serves the build tools should the repository hold only an sdist.
    if ! "$VENV/bin/python" -m pip download -q --no-deps --extra-index-url "$NXD_INDEX" -d "$VENV/nxd-dist" \
        "$NXD_REQ"; then
        echo "setup_venv.sh: could not download $NXD_REQ from the Neuron pip repository ($NXD_INDEX); without" \
            "access to it, set NXD_SOURCE to $LOCAL_COPY" >&2
        exit 2
    fi
    nxd="$(ls "$VENV"/nxd-dist/*)"
fi
PIP=("$VENV/bin/python" -m pip install -q -c constraints-neuron.txt)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch torch-xla safetensors tenacity packaging setuptools boto3
# --no-deps: NxD's setup.py requires torch-neuronx, whose PyPI package is an empty placeholder.
"$VENV/bin/python" -m pip install -q --no-deps "$nxd"
rm -rf "$VENV/nxd-dist"
"${PIP[@]}" -e . pytest
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import sys; sys.path.insert(0, '$PWD/tests/neuron'); import neuron_stub; neuron_stub.install()" \
    > "$site/hlat_neuron_stub.pth"
echo "$key" > "$VENV/.key"
echo "NxD lane: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
