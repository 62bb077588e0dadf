#!/usr/bin/env bash
# What the image lane needs from Debian (make test-image runs this first): podman (rootful, daemonless), runc (crun
# 1.8 refuses a VM whose cgroups are in hybrid mode) and debootstrap (the local Debian base: no registry is used).
# Quick when they are there; about 20 s on a fresh machine. Needs root; changes nothing in /etc/containers
# (tests/image/containers.conf is named by CONTAINERS_CONF instead).
set -euo pipefail
missing=0
for b in podman runc debootstrap; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing=1
done
if [ "$missing" = 0 ]; then
  exit 0
fi
start=$(date +%s)
# Another lane's apt-get (the cluster lane's, beside this one in .ci/run) may hold dpkg's lock: wait for it.
apt-get -o DPkg::Lock::Timeout=600 update -q
DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
  podman runc debootstrap
echo "image lane: installed podman runc debootstrap in $(( $(date +%s) - start )) s"
