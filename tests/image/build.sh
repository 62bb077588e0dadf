#!/usr/bin/env bash
# Builds the image lane's images with podman, without a container registry (make test-image runs it through
# tests/image/conftest.py; run it by hand to get the same images):
#   localhost/hlat-base/debian:bookworm   debootstrap --variant=minbase from the Debian mirror apt already uses
#   localhost/hlat-base/python:3.11       Debian's python3 in a venv on it: the stand-in for python:3.12-slim
#   localhost/hlat-base/dlc:standin       the python base + CPU torch: the stand-in for the Neuron DLC
#   hlat:cpu                              the Dockerfile's cpu target, unmodified, on the python base
#   hlat:trn1                             the Dockerfile's trn1 target on the DLC stand-in (docker format)
# A base that exists is kept; the hlat images are rebuilt on podman's layer cache (seconds when nothing changed).
# pip in a build reads the host's CA bundle through a read-only bind mount (never copied into an image), and
# torch and its dependencies come from a local PEP 503 index in $HLAT_IMAGE_CACHE, downloaded once with the
# host's pip (HLAT_IMAGE_TORCH_PIP_ARGS: e.g. "--index-url https://download.pytorch.org/whl/cpu
# --extra-index-url https://pypi.org/simple" where pip's own configuration would pick PyPI's CUDA torch).
# Usage: tests/image/build.sh [bases|cpu|trn1|all]   (all: the default)
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/image
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/$here/containers.conf}"
cache="${HLAT_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hlat-image}"
host_python="${HLAT_IMAGE_HOST_PYTHON:-python3}"
ca_bundle="${HLAT_IMAGE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
what="${1:-all}"
mkdir -p "$cache"

log() { echo "image lane: $*" >&2; }

# debootstrap needs a mirror: the first Debian one apt uses (deb822 .sources or a one-line sources.list).
debian_mirror() {
    local uri
    uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1)
    [ -n "$uri" ] || uri=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        | awk '{print $2}' | grep -v security | head -n1)
    echo "${uri:-http://deb.debian.org/debian}"
}

base_debian() {
    podman image exists localhost/hlat-base/debian:bookworm && return
    local rootfs start
    start=$(date +%s)
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$rootfs" "$(debian_mirror)" >"$cache/debootstrap.log" 2>&1 \
        || { tail -n 20 "$cache/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | podman import - localhost/hlat-base/debian:bookworm >/dev/null
    rm -rf "$rootfs"
    log "debian base (debootstrap minbase bookworm) in $(( $(date +%s) - start )) s"
}

# pip.conf for builds: names the host CA bundle at the path it is mounted on (pip reads /etc/pip.conf).
pip_conf() {
    printf '[global]\ncert = /run/hlat-host-ca.crt\n' > "$cache/pip.conf"
}

# Every podman build of the lane: the CA bundle and pip.conf mounted read-only, the wheel index at /wheels.
build() {
    pip_conf
    podman build --network host \
        -v "$ca_bundle:/run/hlat-host-ca.crt:ro" -v "$cache/pip.conf:/etc/pip.conf:ro" \
        -v "$cache/wheels:/wheels:ro" "$@"
}

base_python() {
    podman image exists localhost/hlat-base/python:3.11 && return
    local start
    start=$(date +%s)
    build -t localhost/hlat-base/python:3.11 -f "$here/python.Containerfile" "$here" >&2
    log "python base (Debian's python3) in $(( $(date +%s) - start )) s"
}

# torch==<constraints.txt's> and its dependencies as a PEP 503 index (cache/wheels/simple/<name>/index.html).
wheel_index() {
    [ -f "$cache/wheels/simple/torch/index.html" ] && return
    local start
    start=$(date +%s)
    mkdir -p "$cache/wheels/files"
    # shellcheck disable=SC2086  # the pip arguments are words on purpose
    "$host_python" -m pip download -q --only-binary=:all: --python-version 3.11 --dest "$cache/wheels/files" \
        ${HLAT_IMAGE_TORCH_PIP_ARGS:-} -c constraints.txt torch
    compgen -G "$cache/wheels/files/torch-*+cpu-*.whl" >/dev/null || {
        echo "image lane: the torch wheel in $cache/wheels/files is not a CPU build; set" \
            "HLAT_IMAGE_TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu" \
            "--extra-index-url https://pypi.org/simple' and remove $cache/wheels" >&2
        exit 1
    }
    "$host_python" - "$cache/wheels" <<'EOF'
import re, sys
from pathlib import Path
root = Path(sys.argv[1])
for f in sorted((root / "files").iterdir()):
    name = re.sub(r"[-_.]+", "-", f.name.split("-")[0]).lower()
    page = root / "simple" / name / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    old = page.read_text() if page.exists() else ""
    page.write_text(old + f'<a href="../../files/{f.name}">{f.name}</a>\n')
EOF
    log "torch wheel index in $(( $(date +%s) - start )) s"
}

base_dlc() {
    podman image exists localhost/hlat-base/dlc:standin && return
    build -t localhost/hlat-base/dlc:standin -f "$here/dlc-standin.Containerfile" "$here" >&2
}

image_cpu() {
    local start
    start=$(date +%s)
    build --target cpu -t hlat:cpu --build-arg PYTHON_BASE_IMAGE=localhost/hlat-base/python:3.11 \
        --build-arg TORCH_INDEX_URL=file:///wheels/simple . >&2
    log "hlat:cpu in $(( $(date +%s) - start )) s"
}

# --format docker: HEALTHCHECK NONE survives only in the docker image format (OCI has no healthcheck field).
image_trn1() {
    local start
    start=$(date +%s)
    build --format docker --target trn1 -t hlat:trn1 --build-arg NEURON_DLC_IMAGE=localhost/hlat-base/dlc \
        --build-arg NEURON_DLC_TAG=standin . >&2
    log "hlat:trn1 in $(( $(date +%s) - start )) s"
}

case "$what" in
    bases) base_debian; wheel_index; base_python; base_dlc ;;
    cpu) base_debian; wheel_index; base_python; image_cpu ;;
    trn1) base_debian; wheel_index; base_python; base_dlc; image_trn1 ;;
    all) base_debian; wheel_index; base_python; base_dlc; image_cpu; image_trn1 ;;
    *) echo "usage: $0 [bases|cpu|trn1|all]" >&2; exit 2 ;;
esac
# The images a rebuild replaced (untagged, no child): 2 GB each. The layers of the current images stay cached.
podman image prune --force >/dev/null
